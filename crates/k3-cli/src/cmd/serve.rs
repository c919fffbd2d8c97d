//! `k3 serve`: the OpenAI-compatible server. Arguments and logic live in `k3-server`.

pub use k3_server::ServeArgs as Args;

pub fn run(a: Args) -> anyhow::Result<()> {
    k3_server::run_serve(a)?;
    Ok(())
}
