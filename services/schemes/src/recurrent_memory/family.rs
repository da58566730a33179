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
use wavefront_engine::{Active, Family, FamilyError, FinishReason, Moved, SlotId};
use wavefront_models::armt::{Armt, CellInput, MemoryView, StepShape};
use wavefront_models::transformer::{Keys, KvPool, MaskRule, SeqInput, PAGE_SIZE};

use super::program::{ArmtOutput, ArmtPlan, ArmtProgram};
use crate::paging;
use crate::tick::{entries, to_candle};

/// One active program as a tick sees it.
pub type Entry<'a> = crate::tick::Entry<'a, ArmtProgram>;

/// What one tick computed.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TickReport {
    /// Rows through the model: every cell's and every packed row.
    pub rows: usize,
    /// The grouped step's shape, when one ran.
    pub grouped: Option<StepShape>,
}

/// Runs one tick of every program in `batch` (see the module doc): each program plans, the
/// plans run packed ([`run`]), and each program commits its output. A failure of a packed call
/// fails the tick; a program's own failure to commit goes to its outbox.
pub fn tick(model: &Armt, batch: &mut [Entry<'_>]) -> candle_core::Result<TickReport> {
    let n_layers = model.config().n_layers();
    for e in batch.iter_mut() {
        if e.program.memory.is_none() {
            e.program.memory = Some(model.new_memory().map_err(to_candle)?);
        }
    }
    let plans: Vec<ArmtPlan> = batch.iter().map(|e| e.program.plan(n_layers)).collect();
    let (outputs, report) = run(model, batch, &plans)?;
    for ((e, plan), out) in batch.iter_mut().zip(&plans).zip(outputs) {
        if let Err(err) = e.program.commit(plan, out, n_layers, e.outbox) {
            e.outbox.fail(FamilyError::commit("recurrent-memory", err));
        }
    }
    Ok(report)
}

/// Runs `plans` (one per entry of `batch`, in order) in packed calls: one grouped step for every
/// diagonal, one pass through the layers for every sequential segment and decoding token, one
/// head call over the rows that choose a token. Writes only what the forwards themselves write
/// (caches); memories, residual streams and tokens go to each program in its [`ArmtOutput`].
pub fn run(
    model: &Armt,
    batch: &mut [Entry<'_>],
    plans: &[ArmtPlan],
) -> candle_core::Result<(Vec<ArmtOutput>, TickReport)> {
    let mut report = TickReport::default();
    let mut outputs: Vec<ArmtOutput> = plans.iter().map(|_| ArmtOutput::default()).collect();
    // Rows whose logits choose a token: (entry, hidden row [1, d]).
    let mut heads: Vec<(usize, Tensor)> = Vec::new();
    let diagonal: Vec<usize> = (0..plans.len())
        .filter(|&i| matches!(plans[i], ArmtPlan::Diagonal { .. }))
        .collect();
    if !diagonal.is_empty() {
        grouped_step(
            model,
            batch,
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
            batch,
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
    let logits = model.logits(&Tensor::cat(&rows, 0)?).map_err(to_candle)?;
    let greedy = heads.iter().all(|(i, _)| batch[*i].program.is_greedy());
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
        if out.token.is_none() || batch[*i].program.records_logits() {
            out.logits = Some(logits.get(k)?.to_vec1::<f32>()?);
        }
    }
    Ok((outputs, report))
}

/// The diagonals of `members`, in one grouped call.
fn grouped_step(
    model: &Armt,
    batch: &mut [Entry<'_>],
    plans: &[ArmtPlan],
    members: &[usize],
    outputs: &mut [ArmtOutput],
    heads: &mut Vec<(usize, Tensor)>,
    report: &mut TickReport,
) -> candle_core::Result<()> {
    let n_layers = model.config().n_layers();
    // (entry, segment, layer) of every cell, and the residual stream entering it.
    let mut placed: Vec<(usize, usize, usize)> = Vec::new();
    let mut hidden: Vec<Tensor> = Vec::new();
    for &i in members {
        let ArmtPlan::Diagonal { cells } = &plans[i] else {
            continue;
        };
        let p = &*batch[i].program;
        for &(s, l) in cells {
            let h = match p.inflight.get(&s) {
                Some(h) => h.tensor().clone(),
                None if l == 0 => model
                    .segment_input(p.segment_ids(s), !p.is_prompt_segment(s))
                    .map_err(to_candle)?,
                None => candle_core::bail!("segment {s} is not in flight before layer {l}"),
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
                let p = &*batch[i].program;
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
        model.grouped_step(&cells).map_err(to_candle)?
    };
    report.grouped = Some(shape);
    for (&(i, s, l), out) in placed.iter().zip(cells_out) {
        let p = &mut *batch[i].program;
        if let Some(kv) = out.kv {
            // The prompt segment's keys: written by the forward, as a packed pass writes them.
            model.store_kv(&mut p.cache, l, kv).map_err(to_candle)?;
        }
        if l + 1 == n_layers && p.is_prompt_segment(s) {
            let n = out.hidden.dim(0)?;
            heads.push((i, out.hidden.narrow(0, n - 1, 1)?));
        }
        // A stream a layer above still reads waits in a pool slot; the top layer's is dropped.
        let hidden = if l + 1 < n_layers {
            model.pooled_stream(&out.hidden).map_err(to_candle)?
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
    batch: &mut [Entry<'_>],
    plans: &[ArmtPlan],
    members: &[usize],
    outputs: &mut [ArmtOutput],
    heads: &mut Vec<(usize, Tensor)>,
    report: &mut TickReport,
) -> candle_core::Result<()> {
    // Each member's input rows, and whether its last row chooses a token.
    let mut xs = Vec::with_capacity(members.len());
    let mut choose = Vec::with_capacity(members.len());
    for &i in members {
        let p = &*batch[i].program;
        let x = match &plans[i] {
            ArmtPlan::Segment { segment, prompt } => {
                choose.push(*prompt);
                model.segment_input(p.segment_ids(*segment), !*prompt)
            }
            ArmtPlan::Decode { token, .. } => {
                choose.push(true);
                model.embed(&[*token])
            }
            _ => candle_core::bail!("a packed pass got a diagonal or idle plan"),
        }
        .map_err(to_candle)?;
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
        for (k, e) in batch
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
        model
            .forward_layers_deferred(&x, &mut seqs, &mems)
            .map_err(to_candle)?
    };
    let mut offset = 0;
    for ((k, &i), w) in members.iter().enumerate().zip(writes) {
        let n = rows[k];
        if choose[k] {
            heads.push((i, out.narrow(0, offset + n - 1, 1)?));
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
    last_rows: Option<usize>,
}

impl RecurrentMemoryFamily {
    pub fn new(model: Armt) -> Self {
        Self {
            model,
            pool: KvPool::shared(PAGE_SIZE),
            last_rows: None,
        }
    }

    /// Pages of `page` positions (the planner's page size).
    pub fn with_page_size(mut self, page: usize) -> Self {
        self.pool = KvPool::shared(page.max(1));
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
        let err = |e: String| FamilyError::commit("recurrent-memory", e);
        if !resuming {
            // Copies: the slots go back with the originals.
            return a
                .program
                .move_state(&Device::Cpu)
                .map_err(|e| err(e.to_string()));
        }
        let p = &mut a.program;
        if let Some(memory) = &p.memory {
            let pooled = self
                .model
                .pooled_memory(memory)
                .map_err(|e| err(e.to_string()))?;
            p.memory = Some(pooled);
        }
        for x in p.inflight.values_mut() {
            *x = self
                .model
                .pooled_stream(x.tensor())
                .map_err(|e| err(e.to_string()))?;
        }
        Ok(())
    }
}

impl Family for RecurrentMemoryFamily {
    type Program = ArmtProgram;

    fn export(&mut self, a: &mut Active<ArmtProgram>) -> Result<Vec<u8>, FamilyError> {
        crate::migrate::export(&a.program, "recurrent-memory")
    }

    fn tick(&mut self, batch: &mut [&mut Active<ArmtProgram>]) -> Result<(), FamilyError> {
        for a in batch.iter_mut() {
            self.bind(a);
        }
        let mut entries = entries(batch, |_| true);
        let report = tick(&self.model, &mut entries).map_err(FamilyError::forward)?;
        self.last_rows = Some(report.rows);
        Ok(())
    }

    fn release(&mut self, program: &mut Active<ArmtProgram>) {
        program.program.release();
    }

    fn stop(&mut self, a: &mut Active<ArmtProgram>) {
        a.program.finish(FinishReason::StopString, &mut a.outbox);
    }

    fn last_tick_rows(&self) -> Option<usize> {
        self.last_rows
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
        let mut moved = paging::swap_out(&mut a.program.cache, "recurrent-memory")?;
        self.move_state(a, &mut moved, false)?;
        Ok(moved)
    }

    fn resume(&mut self, a: &mut Active<ArmtProgram>) -> Result<Moved, FamilyError> {
        self.bind(a);
        let mut moved = paging::swap_in(&mut a.program.cache, "recurrent-memory")?;
        self.move_state(a, &mut moved, true)?;
        Ok(moved)
    }
}
