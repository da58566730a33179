//! The recurrent-memory family: what one engine tick runs for every active ARMT request.
//!
//! 1. **One grouped step** ([`wavefront_models::Armt::grouped_step`]) with the current
//!    diagonal of every request in diagonal prefill: request r at step `i_r` contributes cells
//!    `(s, i_r - s)`; requests that started at different ticks sit at different diagonals and
//!    share the layers they both touch. Every read of the step sees the memories as the tick
//!    found them; the writes come back and are applied after the step.
//! 2. **One pass through the layers** of the shared block ([`wavefront_models::Armt::forward_layers`])
//!    with the rows of every sequential segment (one per request in sequential prefill) and every
//!    decoding token, each against its own keys and memories.
//! 3. **One head call** over the rows that choose a token: the last row of each prompt segment
//!    that reached the top layer this tick, and every decoding row.
//!
//! Each program plans its part ([`ArmtPlan`]) before the calls, the calls return each plan's
//! output ([`ArmtOutput`]: cell outputs, memory writes, the chosen token) without touching a
//! program's memories, and each program commits its own ([`ArmtProgram::commit`]).
//!
//! Nothing a request computes depends on which other requests share the tick: packed rows never
//! mix (attention is per cell or per sequence, memories per request), so its tokens are the same
//! alone or batched.

use candle_core::{DType, Device, Tensor};
use wavefront_engine::{
    Active, Adopted, Demand, Family, FamilyError, FinishReason, Group, Moved, Phase, Planned,
    SlotId,
};
use wavefront_models::armt::{Armt, CellInput, MemoryView, StepShape};
use wavefront_models::transformer::{Keys, KvPool, MaskRule, SeqInput, PAGE_SIZE};
use wavefront_models::ModelFamily;

use super::program::{ArmtOutput, ArmtPlan, ArmtProgram};
use crate::paging;
use crate::sampling::score_hidden;
use crate::SchemeError;

/// This family's name.
const FAMILY: &str = ModelFamily::RecurrentMemory.name();

/// What one run of the packed calls computed.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RunReport {
    /// Rows through the model: every cell's and every packed row.
    pub rows: usize,
    /// The grouped step's shape, when one ran.
    pub grouped: Option<StepShape>,
}

/// Runs the plans of `work` in packed calls: one grouped step for every diagonal, one pass
/// through the layers for every sequential segment and decoding token, one head call over the
/// rows that choose a token. Writes only what the forwards themselves write (caches); memories,
/// residual streams and tokens go to each program in its [`ArmtOutput`].
pub fn run(
    model: &Armt,
    work: &mut [Planned<'_, ArmtProgram, ArmtPlan>],
) -> Result<(Vec<ArmtOutput>, RunReport), SchemeError> {
    let mut report = RunReport::default();
    let plans: Vec<ArmtPlan> = work.iter().map(|w| w.plan.clone()).collect();
    let plans = plans.as_slice();
    let mut outputs: Vec<ArmtOutput> = plans.iter().map(|_| ArmtOutput::default()).collect();
    // Rows whose logits choose a token: (entry, hidden row [1, d]).
    let mut heads: Vec<(usize, Tensor)> = Vec::new();
    let diagonal: Vec<usize> = (0..plans.len())
        .filter(|&i| matches!(plans[i], ArmtPlan::Diagonal { .. }))
        .collect();
    if !diagonal.is_empty() {
        grouped_step(
            model,
            work,
            plans,
            &diagonal,
            &mut outputs,
            &mut heads,
            &mut report,
        )?;
    }
    let packed: Vec<usize> = (0..plans.len())
        .filter(|&i| matches!(plans[i], ArmtPlan::Segment { .. } | ArmtPlan::Decode { .. }))
        .collect();
    if !packed.is_empty() {
        layer_pass(
            model,
            work,
            plans,
            &packed,
            &mut outputs,
            &mut heads,
            &mut report,
        )?;
    }
    if heads.is_empty() {
        return Ok((outputs, report));
    }
    let rows: Vec<Tensor> = heads.iter().map(|(_, r)| r.clone()).collect();
    let logits = model.logits(&Tensor::cat(&rows, 0)?)?;
    let greedy = heads.iter().all(|(i, _)| work[*i].program.is_greedy());
    let tokens: Option<Vec<u32>> = if greedy {
        Some(
            logits
                .argmax(candle_core::D::Minus1)?
                .to_dtype(DType::U32)?
                .to_vec1()?,
        )
    } else {
        None
    };
    for (k, (i, _)) in heads.iter().enumerate() {
        let out = &mut outputs[*i];
        out.token = tokens.as_ref().map(|t| t[k]);
        if out.token.is_none() || work[*i].program.records_logits() {
            out.logits = Some(logits.get(k)?.to_vec1::<f32>()?);
        }
    }
    Ok((outputs, report))
}

/// The diagonals of `members`, in one grouped call.
fn grouped_step(
    model: &Armt,
    work: &mut [Planned<'_, ArmtProgram, ArmtPlan>],
    plans: &[ArmtPlan],
    members: &[usize],
    outputs: &mut [ArmtOutput],
    heads: &mut Vec<(usize, Tensor)>,
    report: &mut RunReport,
) -> Result<(), SchemeError> {
    let n_layers = model.config().n_layers();
    // (entry, segment, layer) of every cell, and the residual stream entering it.
    let mut placed: Vec<(usize, usize, usize)> = Vec::new();
    let mut hidden: Vec<Tensor> = Vec::new();
    for &i in members {
        let ArmtPlan::Diagonal { cells } = &plans[i] else {
            continue;
        };
        let p = &*work[i].program;
        for &(s, l) in cells {
            let h = match p.inflight.get(&s) {
                Some(h) => h.tensor().clone(),
                None if l == 0 => model.segment_input(p.segment_ids(s), !p.is_prompt_segment(s))?,
                None => {
                    return Err(SchemeError::inconsistent(format!(
                        "segment {s} is not in flight before layer {l}"
                    )))
                }
            };
            placed.push((i, s, l));
            hidden.push(h);
        }
    }
    let (cells_out, shape) = {
        let cells: Vec<CellInput> = placed
            .iter()
            .zip(hidden)
            .map(|(&(i, s, l), hidden)| {
                let p = &*work[i].program;
                let prompt = p.is_prompt_segment(s);
                CellInput {
                    layer: l,
                    hidden,
                    memory: &p.memory.as_ref().expect("memories exist")[l],
                    write: !prompt,
                    keep_kv: prompt,
                }
            })
            .collect();
        report.rows += cells
            .iter()
            .map(|c| c.hidden.dim(0).unwrap_or(0))
            .sum::<usize>();
        model.grouped_step(&cells)?
    };
    report.grouped = Some(shape);
    for (&(i, s, l), out) in placed.iter().zip(cells_out) {
        let p = &mut *work[i].program;
        if let Some(kv) = out.kv {
            // The prompt segment's keys: written by the forward, as a packed pass writes them.
            model.store_kv(&mut p.cache, l, kv)?;
        }
        if l + 1 == n_layers && p.is_prompt_segment(s) {
            let n = out.hidden.dim(0)?;
            heads.push((i, out.hidden.narrow(0, n - 1, 1)?));
        }
        if let (true, Some((targets, top))) = (l + 1 == n_layers, p.score_targets(s)) {
            // The segment's token rows (its memory tokens come after them).
            let rows = out.hidden.narrow(0, 0, targets.len())?;
            let entries = score_hidden(&rows, &targets, top, |r| {
                model
                    .logits(r)
                    .map_err(|e| candle_core::Error::Msg(e.to_string()))
            })?;
            outputs[i].scored.push((s, entries));
        }
        // A stream a layer above still reads waits in a pool slot; the top layer's is dropped.
        let hidden = if l + 1 < n_layers {
            model.pooled_stream(&out.hidden)?
        } else {
            out.hidden.into()
        };
        outputs[i].cells.push((hidden, out.update));
    }
    Ok(())
}

/// Sequential segments and decoding tokens of `members` through every layer.
fn layer_pass(
    model: &Armt,
    work: &mut [Planned<'_, ArmtProgram, ArmtPlan>],
    plans: &[ArmtPlan],
    members: &[usize],
    outputs: &mut [ArmtOutput],
    heads: &mut Vec<(usize, Tensor)>,
    report: &mut RunReport,
) -> Result<(), SchemeError> {
    // Each member's input rows, and whether its last row chooses a token.
    let mut xs = Vec::with_capacity(members.len());
    let mut choose = Vec::with_capacity(members.len());
    for &i in members {
        let p = &*work[i].program;
        let x = match &plans[i] {
            ArmtPlan::Segment { segment, prompt } => {
                choose.push(*prompt);
                model.segment_input(p.segment_ids(*segment), !*prompt)
            }
            ArmtPlan::Decode { token, .. } => {
                choose.push(true);
                model.embed(&[*token])
            }
            _ => {
                return Err(SchemeError::inconsistent(
                    "a packed pass got a diagonal or idle plan",
                ))
            }
        }?;
        xs.push(x);
    }
    let rows: Vec<usize> = xs
        .iter()
        .map(|x| x.dim(0))
        .collect::<candle_core::Result<_>>()?;
    report.rows += rows.iter().sum::<usize>();
    let (out, writes) = {
        let mut seqs = Vec::with_capacity(members.len());
        let mut mems = Vec::with_capacity(members.len());
        for (k, e) in work
            .iter_mut()
            .enumerate()
            .filter(|(i, _)| members.contains(i))
            .map(|(_, e)| e)
            .enumerate()
        {
            let ArmtProgram { cache, memory, .. } = &mut *e.program;
            let n = rows[k];
            let layers = memory.as_deref().expect("memories exist");
            let (seq, write) = match &plans[members[k]] {
                ArmtPlan::Decode { position, .. } => {
                    let pos = *position as u32;
                    let seq = SeqInput {
                        index: vec![pos],
                        positions: vec![pos],
                        mask: MaskRule::Causal,
                        keys: Keys::Buffer {
                            cache,
                            len: *position + 1,
                        },
                    };
                    (seq, false)
                }
                // A memory segment attends to itself only; the prompt segment keeps its keys.
                _ if choose[k] => (
                    SeqInput::dense(n)
                        .with_mask(MaskRule::Causal)
                        .with_keys(Keys::Buffer { cache, len: n }),
                    false,
                ),
                _ => (SeqInput::dense(n).with_mask(MaskRule::Causal), true),
            };
            seqs.push(seq);
            mems.push(MemoryView { layers, write });
        }
        let x = Tensor::cat(&xs, 0)?;
        model.forward_layers_deferred(&x, &mut seqs, &mems)?
    };
    let mut offset = 0;
    for ((k, &i), w) in members.iter().enumerate().zip(writes) {
        let n = rows[k];
        if choose[k] {
            heads.push((i, out.narrow(0, offset + n - 1, 1)?));
        }
        if let ArmtPlan::Segment { segment, .. } = &plans[i] {
            if let Some((targets, top)) = work[i].program.score_targets(*segment) {
                let rows = out.narrow(0, offset, targets.len())?;
                let entries = score_hidden(&rows, &targets, top, |r| {
                    model
                        .logits(r)
                        .map_err(|e| candle_core::Error::Msg(e.to_string()))
                })?;
                outputs[i].scored.push((*segment, entries));
            }
        }
        offset += n;
        outputs[i].writes = w;
    }
    Ok(())
}

/// The family: owns the model and the page pool of its requests' caches on the engine thread.
/// Slot ids granted by the engine are page ids of the pool; memories and residual streams are
/// counted in slots too, and live in the model's own slot pools ([`Armt::new_memory`],
/// [`Armt::pooled_stream`]).
pub struct RecurrentMemoryFamily {
    model: Armt,
    pool: KvPool,
    /// What the last run computed (tests look at its grouped step).
    last_run: RunReport,
}

impl RecurrentMemoryFamily {
    pub fn new(model: Armt) -> Self {
        Self {
            model,
            pool: KvPool::shared(PAGE_SIZE),
            last_run: RunReport::default(),
        }
    }

    pub fn model(&self) -> &Armt {
        &self.model
    }

    /// What the last run of the packed calls computed.
    pub fn last_run(&self) -> RunReport {
        self.last_run
    }

    /// Pages of `page` positions (the planner's page size), storing K/V rows as `kv_dtype` in
    /// host memory (`LoadOptions::kv_store`; `None`: as the model makes them).
    pub fn with_pages(mut self, page: usize, kv_dtype: Option<candle_core::DType>) -> Self {
        self.pool = KvPool::shared_storing(page.max(1), kv_dtype);
        self
    }

    /// Hands the slots granted to `a` since the last look to its cache (moved into the pool on
    /// first sight: programs are built outside the engine thread). Slots beyond the cache's
    /// pages stand for the memories; the cache may hold them as spare pages.
    fn bind(&self, a: &mut Active<ArmtProgram>) {
        let new = a.take_new_slots();
        paging::bind(&mut a.program.cache, &self.pool, new);
    }

    /// Moves a request's memories and residual streams out of their pool slots into host
    /// memory (preempted), or back into slots of the model's pools (`resuming`), counting
    /// their bytes in `moved`.
    fn move_state(
        &self,
        a: &mut Active<ArmtProgram>,
        moved: &mut Moved,
        resuming: bool,
    ) -> Result<(), FamilyError> {
        moved.bytes += a.program.state_bytes() as u64;
        if !resuming {
            // Copies: the slots go back with the originals.
            return a
                .program
                .move_state(&Device::Cpu)
                .map_err(|e| FamilyError::program(FAMILY, Phase::Preempt, e));
        }
        let err = |e| FamilyError::program(FAMILY, Phase::Resume, e);
        let p = &mut a.program;
        if let Some(memory) = &p.memory {
            p.memory = Some(self.model.pooled_memory(memory).map_err(err)?);
        }
        for x in p.inflight.values_mut() {
            *x = self.model.pooled_stream(x.tensor()).map_err(err)?;
        }
        Ok(())
    }
}

impl Family for RecurrentMemoryFamily {
    type Program = ArmtProgram;
    type Plan = ArmtPlan;
    type Output = ArmtOutput;

    fn export(&mut self, a: &mut Active<ArmtProgram>) -> Result<Vec<u8>, FamilyError> {
        crate::migrate::export_unless_constrained(&a.program, FAMILY, a.program.constrained)
    }

    fn pool_bytes(&self) -> u64 {
        self.pool.allocated_bytes() + self.model.pool_bytes()
    }

    fn demand(&self, a: &Active<ArmtProgram>) -> Demand {
        let cfg = self.model.config();
        match a.program.step_rows(cfg.n_layers(), cfg.num_mem_tokens()) {
            0 => Demand::Idle,
            rows => Demand::Whole(rows),
        }
    }

    fn plan(
        &mut self,
        a: &mut Active<ArmtProgram>,
        _rows: usize,
    ) -> Result<Option<ArmtPlan>, FamilyError> {
        self.bind(a);
        if a.program.memory.is_none() {
            let memory = self
                .model
                .new_memory()
                .map_err(|e| FamilyError::program(FAMILY, Phase::Plan, e))?;
            a.program.memory = Some(memory);
        }
        Ok(Some(a.program.plan(self.model.config().n_layers())))
    }

    /// One forward group: the grouped step, the layer pass and the head call share the tick.
    fn run(&mut self, work: &mut [Planned<'_, ArmtProgram, ArmtPlan>]) -> Vec<Group<ArmtOutput>> {
        let outputs = run(&self.model, work)
            .map(|(outputs, report)| {
                self.last_run = report;
                outputs
            })
            .map_err(FamilyError::forward);
        vec![Group::all(work.len(), outputs)]
    }

    fn commit(
        &mut self,
        a: &mut Active<ArmtProgram>,
        plan: ArmtPlan,
        output: ArmtOutput,
    ) -> Result<(), FamilyError> {
        let n_layers = self.model.config().n_layers();
        a.program
            .commit(&plan, output, n_layers, &mut a.outbox)
            .map_err(|e| FamilyError::commit(FAMILY, e))
    }

    fn release(&mut self, program: &mut Active<ArmtProgram>) {
        program.program.release();
    }

    fn stop(&mut self, a: &mut Active<ArmtProgram>) {
        a.program.finish(FinishReason::StopString, &mut a.outbox);
    }

    fn slots_needed(&self, a: &Active<ArmtProgram>) -> usize {
        a.program.pages_needed().max(a.slots.len())
    }

    fn reclaim(&mut self, a: &mut Active<ArmtProgram>) -> Vec<SlotId> {
        let need = a.keeps(a.program.pages_needed());
        let held = a.slots.len();
        paging::reclaim(&mut a.program.cache, held, need)
    }

    fn preempt(&mut self, a: &mut Active<ArmtProgram>) -> Result<Moved, FamilyError> {
        self.bind(a);
        let mut moved = paging::swap_out(&mut a.program.cache, FAMILY)?;
        self.move_state(a, &mut moved, false)?;
        Ok(moved)
    }

    fn resume(&mut self, a: &mut Active<ArmtProgram>) -> Result<Moved, FamilyError> {
        self.bind(a);
        let mut moved = paging::swap_in(&mut a.program.cache, FAMILY)?;
        self.move_state(a, &mut moved, true)?;
        Ok(moved)
    }

    /// The memories a prompt's memory segments leave depend on their ids alone (and the
    /// execution): a request with the same ones takes copies of them.
    fn share_key(&self, program: &ArmtProgram) -> Option<u64> {
        program.share_key()
    }

    fn prompt_pending(&self, a: &Active<ArmtProgram>) -> bool {
        a.program.prompt_pending()
    }

    /// ARMT's prompt state is its memories, not pages: the taker gets copies of the donor's
    /// (a few hundred kilobytes per layer at most, constant in the prompt's length) in its own
    /// memory slots and skips the memory segments; no page is shared.
    fn adopt_prompt(
        &mut self,
        donor: &mut Active<ArmtProgram>,
        taker: &mut Active<ArmtProgram>,
    ) -> Result<Adopted, FamilyError> {
        if !taker.program.can_take_memories_of(&donor.program) {
            return Ok(Adopted::default());
        }
        let memories = donor.program.memories().expect("checked above");
        let copies = self
            .model
            .copied_memory(memories)
            .map_err(|e| FamilyError::program(FAMILY, Phase::Plan, e))?;
        let rows = taker.program.take_memories(copies);
        Ok(Adopted {
            slots: Vec::new(),
            rows,
        })
    }
}
