//! `--speculative draft --draft-model DIR` (issue 22): a separate draft model — another K3-family
//! checkpoint that the CPU model loads (k3-nano, a `k3 init` model, …) with the target's
//! vocabulary — that drafts by chained decode steps of its own. [`DraftSpec`] is the loaded model
//! as the engine's config carries it; the runner holds it beside the target (`dist::draft`: its
//! per-sequence states follow the target's forwards and roll back with them) and the proposer is
//! the draft-model one (`spec::model`). The CPU runner of one rank runs it; elsewhere the engine
//! decodes plainly and says why.

use std::fmt;
use std::path::Path;
use std::sync::Arc;

use k3_model::{Checkpoint, Config, Model};

use crate::error::{EngineError, Result};

/// A loaded draft model and the name it was given by (its directory).
#[derive(Clone)]
pub struct DraftSpec {
    pub model: Arc<Model>,
    pub name: String,
}

impl fmt::Debug for DraftSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let t = &self.model.config.text;
        write!(f, "DraftSpec({}: {} layers, hidden_size {}, vocab_size {})", self.name, self.model.config.layers.len(), t.hidden_size, t.vocab_size)
    }
}

impl DraftSpec {
    /// `model` as the draft model called `name`.
    pub fn new(model: Arc<Model>, name: impl Into<String>) -> DraftSpec {
        DraftSpec { model, name: name.into() }
    }

    /// Loads the checkpoint at `dir` (`--draft-model`) as the draft of the target `target` (its
    /// config; `target_name` names it in errors): the vocabularies must agree (checked before
    /// the weights are read). Errors name the flag.
    pub fn load(dir: &Path, target: &Config, target_name: &str) -> Result<DraftSpec> {
        let name = dir.display().to_string();
        let flag = |e: &dyn fmt::Display| EngineError::Unsupported(format!("--draft-model {name}: {e}"));
        let ck = Checkpoint::open(dir).map_err(|e| flag(&e))?;
        check_vocab(target, target_name, &ck.config, &name)?;
        let model = Model::load(&ck).map_err(|e| flag(&e))?;
        Ok(DraftSpec::new(Arc::new(model), name))
    }
}

/// A draft model must share the target's vocabulary: its drafts are target token ids, and the
/// rejection sampling compares the two distributions id by id. The error names the flag and
/// both models' `vocab_size`.
pub fn check_vocab(target: &Config, target_name: &str, draft: &Config, draft_name: &str) -> Result<()> {
    let (t, d) = (target.text.vocab_size, draft.text.vocab_size);
    if t == d {
        return Ok(());
    }
    Err(EngineError::Unsupported(format!(
        "--draft-model {draft_name}: its vocab_size is {d}, the target model's ({target_name}) is {t}; a draft model must share the target's vocabulary (give a checkpoint of the same family and tokenizer)"
    )))
}
