//! `k3 serve`: the OpenAI-compatible server. Arguments and logic live in `k3-server`; this
//! file only resolves the default model (the embedded k3-nano).

pub use k3_server::ServeArgs as Args;

pub fn run(mut a: Args) -> anyhow::Result<()> {
    a.model = Some(super::model_dir::resolve_model_dir(a.model.as_deref())?);
    k3_server::run_serve(a)?;
    Ok(())
}
