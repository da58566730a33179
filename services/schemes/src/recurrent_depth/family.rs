//! The recurrent-depth family: every tick runs each scheme's steps in a forward group of its
//! own (all `ar` steps; all diffusion-forcing steps), each one prelude call, one core call per
//! recurrence over the steps still iterating, and one coda call.

use candle_core::Device;
use wavefront_engine::{
    Active, Adopted, Demand, Family, FamilyError, FinishReason, Group, Moved, Phase, Planned,
    SlotId,
};
use wavefront_models::transformer::{KvPool, PAGE_SIZE};
use wavefront_models::{Huginn, ModelFamily};

use super::planner::Program;
use super::{ar, diffusion};
use crate::paging;
use crate::SchemeError;

/// This family's name.
const FAMILY: &str = ModelFamily::RecurrentDepth.name();

/// A recurrent-depth step as plain data: one token (or a chunk of a prefill) of `ar`, or the
/// prefill or one outer step of diffusion forcing.
#[derive(Debug)]
pub enum HuginnPlan {
    Ar(ar::ArPlan),
    Diffusion(diffusion::DfPlan),
}

/// What the packed forwards produced for one [`HuginnPlan`].
#[derive(Debug)]
pub enum HuginnOutput {
    Ar(ar::ArOutput),
    Diffusion(diffusion::DfOutput),
}

/// The family: owns the model and the page pool of its requests' caches on the engine thread.
/// Slot ids granted by the engine are page ids of the pool (K/V pages, and a diffusion-forcing
/// request's latent pages, which hold its wavefront's states). Each scheme's steps run in a
/// forward group of their own: one prelude, one core call per recurrence and one coda call
/// over every request of the scheme.
pub struct HuginnFamily {
    model: Huginn,
    pool: KvPool,
    /// Tests: the scheme group whose next forward fails.
    #[cfg(test)]
    pub(crate) fail_next: Option<&'static str>,
}

impl HuginnFamily {
    pub fn new(model: Huginn) -> Self {
        Self {
            model,
            pool: KvPool::shared(PAGE_SIZE),
            #[cfg(test)]
            fail_next: None,
        }
    }

    /// Pages of `page` positions (the planner's page size), storing K/V rows as `kv_dtype` in
    /// host memory (`LoadOptions::kv_store`; `None`: as the model makes them).
    pub fn with_pages(mut self, page: usize, kv_dtype: Option<candle_core::DType>) -> Self {
        self.pool = KvPool::shared_storing(page.max(1), kv_dtype);
        self
    }

    pub fn model(&self) -> &Huginn {
        &self.model
    }

    /// Hands the slots granted to `a` since the last look to its cache (moved into the pool on
    /// first sight: programs are built outside the engine thread).
    fn bind(&self, a: &mut Active<Program>) {
        let new = a.take_new_slots();
        paging::bind(a.program.state_cache(), &self.pool, new);
    }

    /// Moves a preempted request's latent states to host memory, or back to the model's device.
    fn move_latents(&self, a: &mut Active<Program>, device: &Device) -> Result<(), FamilyError> {
        let moved = match &mut a.program {
            Program::Ar(p) => p
                .warm_state
                .as_mut()
                .map(|w| w.to_device(device).map(|t| *w = t))
                .transpose()
                .map(|_| ()),
            // Diffusion forcing's states are in its cache's pages: they move with them.
            Program::Diffusion(_) => Ok(()),
        };
        let phase = if device.is_cpu() {
            Phase::Preempt
        } else {
            Phase::Resume
        };
        moved.map_err(|e| FamilyError::program(FAMILY, phase, e))
    }

    /// A fault injected by a test into `group`'s next forward.
    fn injected(&mut self, group: &'static str) -> Result<(), SchemeError> {
        #[cfg(test)]
        if self.fail_next == Some(group) {
            self.fail_next = None;
            return Err(SchemeError::Unsupported(format!(
                "injected failure of the {group} forward"
            )));
        }
        let _ = group;
        Ok(())
    }
}

impl Family for HuginnFamily {
    type Program = Program;
    type Plan = HuginnPlan;
    type Output = HuginnOutput;

    fn pool_bytes(&self) -> u64 {
        self.pool.allocated_bytes()
    }

    /// A static `ar` prefill may run in chunks (an adaptive exit averages the latent change over
    /// the positions of the call, so its prefill runs whole); every other step runs whole.
    fn demand(&self, a: &Active<Program>) -> Demand {
        match &a.program {
            Program::Ar(p) if ar::chunkable(p) => Demand::Prefill(p.pending.len()),
            Program::Ar(p) => Demand::Whole(p.pending.len()),
            Program::Diffusion(p) => Demand::Whole(p.next_rows()),
        }
    }

    fn plan(
        &mut self,
        a: &mut Active<Program>,
        rows: usize,
    ) -> Result<Option<HuginnPlan>, FamilyError> {
        self.bind(a);
        let cfg = self.model.config();
        let planned = match &mut a.program {
            Program::Ar(p) => p.plan(rows, cfg.n_embd).map(HuginnPlan::Ar),
            Program::Diffusion(p) => {
                // A request whose next wavefront would leave the RoPE table stops here.
                if p.leaves_context(cfg.block_size) {
                    p.finish(&mut a.outbox, FinishReason::ContextLimit);
                    return Ok(None);
                }
                p.plan(cfg.n_embd, cfg.n_heads).map(HuginnPlan::Diffusion)
            }
        };
        planned
            .map(Some)
            .map_err(|e| FamilyError::program(FAMILY, Phase::Plan, e))
    }

    /// Two forward groups: every `ar` step, and every diffusion-forcing step. A failure of one
    /// group's forwards fails its requests only.
    fn run(&mut self, work: &mut [Planned<'_, Program, HuginnPlan>]) -> Vec<Group<HuginnOutput>> {
        let (mut ar_members, mut ar_plans, mut ar_caches) = (Vec::new(), Vec::new(), Vec::new());
        let (mut df_members, mut df_plans, mut df_caches) = (Vec::new(), Vec::new(), Vec::new());
        let mut mismatched = Vec::new();
        for (i, w) in work.iter_mut().enumerate() {
            let Planned { program, plan } = w;
            match (plan, &mut **program) {
                (HuginnPlan::Ar(plan), Program::Ar(p)) => {
                    ar_members.push(i);
                    ar_plans.push(&*plan);
                    ar_caches.push(&mut p.cache);
                }
                (HuginnPlan::Diffusion(plan), Program::Diffusion(p)) => {
                    df_members.push(i);
                    df_plans.push(&*plan);
                    df_caches.push(&mut p.cache);
                }
                _ => mismatched.push(i),
            }
        }
        let mut groups = Vec::with_capacity(3);
        if !ar_members.is_empty() {
            let outputs = self
                .injected("ar")
                .and_then(|()| ar::run(&self.model, &ar_plans, &mut ar_caches))
                .map(|o| o.into_iter().map(HuginnOutput::Ar).collect())
                .map_err(FamilyError::forward);
            groups.push(Group {
                members: ar_members,
                outputs,
            });
        }
        if !df_members.is_empty() {
            let outputs = self
                .injected("diffusion-forcing")
                .and_then(|()| diffusion::run(&self.model, &df_plans, &mut df_caches))
                .map(|o| o.into_iter().map(HuginnOutput::Diffusion).collect())
                .map_err(FamilyError::forward);
            groups.push(Group {
                members: df_members,
                outputs,
            });
        }
        if !mismatched.is_empty() {
            groups.push(Group {
                members: mismatched,
                outputs: Err(FamilyError::program(
                    FAMILY,
                    Phase::Plan,
                    SchemeError::inconsistent("a plan of another scheme than its program"),
                )),
            });
        }
        groups
    }

    fn commit(
        &mut self,
        a: &mut Active<Program>,
        plan: HuginnPlan,
        output: HuginnOutput,
    ) -> Result<(), FamilyError> {
        let done = match (&mut a.program, plan, output) {
            (Program::Ar(p), HuginnPlan::Ar(plan), HuginnOutput::Ar(out)) => {
                p.commit(&plan, out, &mut a.outbox)
            }
            (Program::Diffusion(p), HuginnPlan::Diffusion(plan), HuginnOutput::Diffusion(out)) => {
                p.commit(&plan, out, &mut a.outbox)
            }
            _ => Err(SchemeError::inconsistent(
                "an output of another scheme than its program",
            )),
        };
        done.map_err(|e| FamilyError::commit(FAMILY, e))
    }

    fn export(&mut self, a: &mut Active<Program>) -> Result<Vec<u8>, FamilyError> {
        let constrained = match &a.program {
            Program::Ar(p) => p.constrained,
            Program::Diffusion(p) => p.constrained,
        };
        crate::migrate::export_unless_constrained(&a.program, FAMILY, constrained)
    }

    fn slots_needed(&self, a: &Active<Program>) -> usize {
        a.program
            .pages_needed(self.model.config())
            .max(a.slots.len())
    }

    fn reclaim(&mut self, a: &mut Active<Program>) -> Vec<SlotId> {
        let need = a.keeps(a.program.pages_needed(self.model.config()));
        let held = a.slots.len();
        paging::reclaim(a.program.state_cache(), held, need)
    }

    fn preempt(&mut self, a: &mut Active<Program>) -> Result<Moved, FamilyError> {
        // A request preempted before its first tick moves its (empty) cache into the pool.
        self.bind(a);
        let moved = paging::swap_out(a.program.state_cache(), FAMILY)?;
        self.move_latents(a, &Device::Cpu)?;
        Ok(moved)
    }

    fn resume(&mut self, a: &mut Active<Program>) -> Result<Moved, FamilyError> {
        self.bind(a);
        let moved = paging::swap_in(a.program.state_cache(), FAMILY)?;
        let device = self.model.device().clone();
        self.move_latents(a, &device)?;
        Ok(moved)
    }

    /// Static `ar` requests with the same prompt, recurrences, cache layout and initial states
    /// (zeros, or one seed's draws) share the prompt's pages; diffusion forcing does not.
    fn share_key(&self, program: &Program) -> Option<u64> {
        match program {
            Program::Ar(p) => p.key.filter(|_| p.prompt.len() > self.pool.page_size()),
            Program::Diffusion(_) => None,
        }
    }

    fn prompt_pending(&self, a: &Active<Program>) -> bool {
        matches!(&a.program, Program::Ar(p) if p.prompt_pending())
    }

    /// Static `ar` prompts that only begin alike, with the same recurrences, cache layout and
    /// initial states: the whole pages of their common prefix.
    fn prefix_rows(&self, donor: &Active<Program>, taker: &Active<Program>) -> usize {
        match (&donor.program, &taker.program) {
            (Program::Ar(d), Program::Ar(t)) => t.shareable(d, self.pool.page_size()),
            _ => 0,
        }
    }

    /// Every cache layer's whole prompt pages before the prompt's last position.
    fn adopt_prompt(
        &mut self,
        donor: &mut Active<Program>,
        taker: &mut Active<Program>,
    ) -> Result<Adopted, FamilyError> {
        let page = self.pool.page_size();
        let rows = match (&donor.program, &taker.program) {
            (Program::Ar(d), Program::Ar(t)) => t.shareable(d, page),
            _ => 0,
        };
        if rows == 0 {
            return Ok(Adopted::default());
        }
        self.bind(taker);
        let fail = |e| FamilyError::program(FAMILY, Phase::Plan, e);
        let (Program::Ar(d), Program::Ar(t)) = (&mut donor.program, &mut taker.program) else {
            unreachable!("both are ar requests (checked above)")
        };
        let ids = t
            .cache
            .share_prefix(&mut d.cache, rows / page)
            .map_err(|e| fail(SchemeError::from(e)))?;
        if let Err(e) = t.skip_prompt(rows, self.model.config().n_embd) {
            t.cache.clear();
            return Err(fail(e));
        }
        Ok(Adopted {
            slots: ids.into_iter().map(SlotId).collect(),
            rows,
        })
    }

    fn stop(&mut self, a: &mut Active<Program>) {
        match &mut a.program {
            Program::Ar(p) => {
                let stats = std::mem::take(&mut p.stats);
                a.outbox.finish(FinishReason::StopString, stats);
            }
            Program::Diffusion(p) => p.finish(&mut a.outbox, FinishReason::StopString),
        }
    }
}
