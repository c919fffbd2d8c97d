//! One module per `k3` subcommand.
pub mod bench;
pub mod init;
pub mod inspect;
pub mod logits;
pub mod model_dir;
pub mod run;
pub mod serve;
pub mod tokenize;
pub mod vision;
