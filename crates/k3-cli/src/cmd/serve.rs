//! `k3 serve`: the OpenAI-compatible server. Arguments and logic live in `k3-server`; this
//! file adds the shared `--tp/--ep/--pp` and node (`--nnodes --node-rank --master-addr`) flags
//! and resolves the default model (the embedded k3-nano).

#[derive(clap::Args)]
pub struct Args {
    #[command(flatten)]
    pub serve: k3_server::ServeArgs,
    #[command(flatten)]
    pub parallel: super::args::ParallelArgs,
    #[command(flatten)]
    pub launch: super::args::LaunchArgs,
}

pub fn run(mut a: Args) -> anyhow::Result<()> {
    let par = a.parallel.layout()?;
    a.serve.model = Some(super::model_dir::resolve_model_dir(a.serve.model.as_deref())?);
    k3_server::run_serve(a.serve, par, &a.launch.node())?;
    Ok(())
}
