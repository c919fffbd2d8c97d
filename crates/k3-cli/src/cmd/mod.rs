//! One module per `k3` subcommand.
pub mod logits;
pub mod vision;
