//! The uniform-diffusion family (DiffusionGemma): every engine tick runs one step of every
//! active program in a single packed forward — encoder passes (a prompt's prefill, possibly in
//! chunks, or a finished canvas) and denoising steps side by side, each over its own cache —
//! then one head call over the denoised canvases' rows and one product for their
//! self-conditioning inputs; then each program commits. Slot ids granted by the engine are page
//! ids of the family's pool.

use candle_core::Tensor;
use wavefront_engine::{Demand, FinishReason, Outbox, Planned};
use wavefront_models::diffusion_gemma::Mode;
use wavefront_models::{DiffusionGemma, ModelFamily};

use super::program::{UdPlan, UdProgram};
use crate::packing::head_rows;
use crate::paging::{self, OneCacheFamily, Stepper};
use crate::SchemeError;

/// This family's name.
const FAMILY: &str = ModelFamily::UniformDiffusion.name();

/// DiffusionGemma's steps.
pub struct UniformDiffusion {
    model: DiffusionGemma,
}

/// The family: the model's steps and the page pool of its requests' caches.
pub type UniformDiffusionFamily = OneCacheFamily<UniformDiffusion>;

impl OneCacheFamily<UniformDiffusion> {
    pub fn new(model: DiffusionGemma) -> Self {
        Self::with_stepper(UniformDiffusion { model })
    }

    pub fn model(&self) -> &DiffusionGemma {
        &self.stepper().model
    }
}

impl paging::OneCache for UdProgram {
    fn cache(&mut self) -> &mut wavefront_models::transformer::KvCache {
        &mut self.cache
    }

    fn pages_needed(&self, page: usize) -> usize {
        UdProgram::pages_needed(self, page)
    }

    fn is_done(&self) -> bool {
        UdProgram::is_done(self)
    }

    fn constrained(&self) -> bool {
        self.constrained
    }
}

/// Runs every plan of `work` in one packed forward, and the head over the denoising steps'
/// rows; returns each plan's logits `[L, V]` (float32), `None` for encoder passes.
pub(crate) fn run(
    model: &DiffusionGemma,
    work: &mut [Planned<'_, UdProgram, UdPlan>],
) -> Result<Vec<Option<Tensor>>, SchemeError> {
    let (device, dtype) = (model.device().clone(), model.dtype());
    let hidden = model.config().hidden_size;
    let h = {
        let mut seqs = Vec::with_capacity(work.len());
        for w in work.iter_mut() {
            seqs.push(w.program.sequence(&w.plan, &device, dtype, hidden)?);
        }
        model.forward(&mut seqs)?
    };
    let mut select = Vec::new();
    let mut offset = 0;
    for w in work.iter() {
        if w.plan.mode == Mode::Denoise {
            select.extend((offset..offset + w.plan.ids.len()).map(|r| r as u32));
        }
        offset += w.plan.ids.len();
    }
    let logits = head_rows(&h, &select, |rows| model.logits(rows))?;
    let mut at = 0;
    work.iter()
        .map(|w| {
            if w.plan.mode != Mode::Denoise {
                return Ok(None);
            }
            let n = w.plan.ids.len();
            let l = logits.as_ref().map(|l| l.narrow(0, at, n)).transpose()?;
            at += n;
            Ok(l)
        })
        .collect()
}

impl Stepper for UniformDiffusion {
    type Program = UdProgram;
    type Plan = UdPlan;
    type Output = Option<Tensor>;
    const FAMILY: &'static str = FAMILY;

    /// A prompt's encoder pass may run in chunks; a canvas's pass and a denoising step run
    /// whole.
    fn demand(&self, p: &UdProgram) -> Demand {
        if p.is_done() {
            return Demand::Idle;
        }
        match p.next_rows() {
            (n, true) => Demand::Prefill(n),
            (n, false) => Demand::Whole(n),
        }
    }

    fn plan(&self, p: &mut UdProgram, rows: usize) -> Result<UdPlan, SchemeError> {
        p.plan(rows)
    }

    fn run(
        &self,
        work: &mut [Planned<'_, UdProgram, UdPlan>],
    ) -> Result<Vec<Option<Tensor>>, SchemeError> {
        run(&self.model, work)
    }

    fn commit(
        &self,
        p: &mut UdProgram,
        plan: UdPlan,
        logits: Option<Tensor>,
        outbox: &mut Outbox,
    ) -> Result<(), SchemeError> {
        if let Some(pl) = p.commit(&plan, logits.as_ref(), outbox)? {
            let soft = self.model.soft_embedding(&pl)?;
            p.set_soft(
                soft.to_dtype(candle_core::DType::F32)?
                    .flatten_all()?
                    .to_vec1()?,
            );
        }
        Ok(())
    }

    fn stop(&self, p: &mut UdProgram, outbox: &mut Outbox) {
        p.finish(FinishReason::StopString, outbox);
    }

    fn share_key(&self, p: &UdProgram, page: usize) -> Option<u64> {
        p.share_key(page)
    }

    fn prompt_pending(&self, p: &UdProgram) -> bool {
        p.prompt_pending()
    }

    fn shareable(&self, donor: &UdProgram, taker: &UdProgram, page: usize) -> usize {
        taker.shareable(donor, page)
    }

    /// The encoded prompt's rows depend on the ids before them alone: a request reads the
    /// common prefix of another prompt's.
    fn prefix_rows(&self, donor: &UdProgram, taker: &UdProgram, page: usize) -> usize {
        taker.shareable(donor, page)
    }

    fn skip_prompt(&self, taker: &mut UdProgram, rows: usize) -> Result<(), SchemeError> {
        taker.skip_prompt(rows)
    }
}
