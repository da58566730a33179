//! The families served here, named once.

/// A model family as clients see it (`ListModels`' `family`, `/v1/models`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum FamilyKind {
    RecurrentDepth,
    RecurrentMemory,
    MaskedDiffusion,
    SlotDiffusion,
}

impl FamilyKind {
    /// The family's name in the API, metrics and logs.
    pub const fn name(self) -> &'static str {
        match self {
            FamilyKind::RecurrentDepth => "recurrent_depth",
            FamilyKind::RecurrentMemory => "recurrent_memory",
            FamilyKind::MaskedDiffusion => "masked_diffusion",
            FamilyKind::SlotDiffusion => "slot_diffusion",
        }
    }
}
