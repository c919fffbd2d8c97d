//! One module per `k3` subcommand.
pub mod args;
pub mod bench;
#[cfg(feature = "cuda")]
pub mod bench_cuda;
pub mod bench_grammar;
pub mod bench_pipeline;
pub mod bench_serve;
pub mod bench_spec;
pub mod init;
pub mod inspect;
pub mod logits;
pub mod model_dir;
pub mod prefix_args;
pub mod run;
pub mod serve;
pub mod tokenize;
pub mod vision;
