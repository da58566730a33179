//! Which family serves a checkpoint. The network is detected once, from the checkpoint's files
//! ([`ModelFiles::architecture`]), into a typed value; each architecture's family module loads
//! it and starts its engine. Nothing else in this crate looks at config names.

use std::sync::Arc;

use wavefront_models::{Architecture, ModelFamily, ModelFiles};

use crate::fingerprint::Fingerprint;
use crate::options::LoadOptions;
use crate::served::ServedModel;
use crate::SchemeError;

/// Loads `files` with the family of its architecture and starts its engine.
pub fn load_model(
    files: ModelFiles,
    mut opts: LoadOptions,
) -> Result<Arc<dyn ServedModel>, SchemeError> {
    let architecture = files.architecture()?;
    opts.fingerprint = Fingerprint::of(&files);
    let family = architecture.family();
    if family != ModelFamily::RecurrentMemory {
        if let Some(n) = opts.max_context_tokens {
            tracing::warn!(
                max_context_tokens = n,
                family = family.name(),
                "the context-length option applies to recurrent-memory models only; ignored"
            );
        }
    }
    match architecture {
        Architecture::Huginn => crate::recurrent_depth::serve(files, opts),
        Architecture::Llada => crate::masked_diffusion::serve(files, opts),
        Architecture::Dream => crate::masked_diffusion::serve_dream(files, opts),
        Architecture::Llada2Moe => crate::block_diffusion::serve(files, opts),
        Architecture::Armt => crate::recurrent_memory::serve(files, opts),
        Architecture::Refusion => crate::slot_diffusion::serve(files, opts),
        Architecture::DiffusionGemma => crate::uniform_diffusion::serve(files, opts),
    }
}
