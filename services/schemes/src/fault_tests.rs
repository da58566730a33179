//! Faults injected into one request's plan, forward or commit, beside a request that succeeds
//! ([`assert_faults_fail_only_their_request`], called by every family's tests): the faulty request
//! fails with the injected error and the other one produces exactly what it produces alone. The
//! families run through the engine's own tick ([`wavefront_engine::run_tick`], driven by
//! [`Standalone`]), wrapped in [`Faulty`].

use anyhow::{bail, ensure, Result};
use wavefront_engine::{
    Active, Demand, EngineError, Event, Family, FamilyError, Group, Moved, Phase, Planned,
    RequestId, SlotId, Standalone,
};

/// Where the fault strikes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    /// The request's plan fails.
    Plan,
    /// The forward its step runs in fails (the family's other requests run in a group of
    /// their own).
    Forward,
    /// Its commit fails.
    Commit,
}

/// An injected failure.
#[derive(Debug, thiserror::Error)]
#[error("injected {0:?} fault")]
pub struct Injected(pub Fault);

/// A family whose request `target` fails with `fault` at its tick `at` (counting from 1).
pub struct Faulty<F: Family> {
    pub inner: F,
    target: RequestId,
    fault: Fault,
    at: u64,
    /// Requests planned this tick, in the order of the tick's work.
    planned: Vec<RequestId>,
    /// Whether the fault strikes this tick.
    armed: bool,
}

impl<F: Family> Faulty<F> {
    pub fn new(inner: F, target: RequestId, fault: Fault, at: u64) -> Self {
        Self {
            inner,
            target,
            fault,
            at,
            planned: Vec::new(),
            armed: false,
        }
    }
}

impl<F: Family> Family for Faulty<F> {
    type Program = F::Program;
    type Plan = F::Plan;
    type Output = F::Output;

    fn demand(&self, a: &Active<F::Program>) -> Demand {
        self.inner.demand(a)
    }

    fn plan(
        &mut self,
        a: &mut Active<F::Program>,
        rows: usize,
    ) -> Result<Option<F::Plan>, FamilyError> {
        let strikes = a.id == self.target && a.ticks == self.at;
        if strikes && self.fault == Fault::Plan {
            return Err(FamilyError::program(
                "test",
                Phase::Plan,
                Injected(Fault::Plan),
            ));
        }
        let plan = self.inner.plan(a, rows)?;
        if plan.is_some() {
            self.planned.push(a.id);
            self.armed |= strikes;
        }
        Ok(plan)
    }

    fn run(&mut self, work: &mut [Planned<'_, F::Program, F::Plan>]) -> Vec<Group<F::Output>> {
        let planned = std::mem::take(&mut self.planned);
        let target = planned.iter().position(|&id| id == self.target);
        let (Some(t), Fault::Forward, true) = (target, self.fault, self.armed) else {
            return self.inner.run(work);
        };
        // The target's step alone in a failing group; the others run as the family runs them.
        let last = work.len() - 1;
        work.swap(t, last);
        let mut groups = self.inner.run(&mut work[..last]);
        work.swap(t, last);
        for g in &mut groups {
            for m in &mut g.members {
                if *m == t {
                    *m = last;
                }
            }
        }
        groups.push(Group {
            members: vec![t],
            outputs: Err(FamilyError::forward(Injected(Fault::Forward))),
        });
        self.armed = false;
        groups
    }

    fn commit(
        &mut self,
        a: &mut Active<F::Program>,
        plan: F::Plan,
        output: F::Output,
    ) -> Result<(), FamilyError> {
        if a.id == self.target && self.armed && self.fault == Fault::Commit {
            self.armed = false;
            return Err(FamilyError::commit("test", Injected(Fault::Commit)));
        }
        self.inner.commit(a, plan, output)
    }

    fn release(&mut self, a: &mut Active<F::Program>) {
        self.inner.release(a)
    }

    fn stop(&mut self, a: &mut Active<F::Program>) {
        self.inner.stop(a)
    }

    fn slots_needed(&self, a: &Active<F::Program>) -> usize {
        self.inner.slots_needed(a)
    }

    fn preempt(&mut self, a: &mut Active<F::Program>) -> Result<Moved, FamilyError> {
        self.inner.preempt(a)
    }

    fn reclaim(&mut self, a: &mut Active<F::Program>) -> Vec<SlotId> {
        self.inner.reclaim(a)
    }

    fn export(&mut self, a: &mut Active<F::Program>) -> Result<Vec<u8>, FamilyError> {
        self.inner.export(a)
    }

    fn resume(&mut self, a: &mut Active<F::Program>) -> Result<Moved, FamilyError> {
        self.inner.resume(a)
    }
}

/// The tokens request `i` of `driver` streamed, and whether it finished (not failed).
fn outcome<F: Family>(driver: &Standalone<F>, i: usize) -> (Vec<u32>, Option<&EngineError>) {
    let mut tokens = Vec::new();
    let mut failed = None;
    for e in driver.active(i).outbox.events() {
        match e {
            Event::Tokens(t) => tokens.extend_from_slice(t),
            Event::Failed(e) => failed = Some(e),
            _ => {}
        }
    }
    (tokens, failed)
}

/// For each fault: request 0 (`faulty()`) fails with it at its second tick, request 1 (`ok()`)
/// beside it streams exactly the tokens it streams alone. `family()` builds a fresh family.
pub fn assert_faults_fail_only_their_request<F: Family>(
    family: impl Fn() -> Result<F>,
    faulty: impl Fn() -> Result<F::Program>,
    ok: impl Fn() -> Result<F::Program>,
) -> Result<()> {
    let alone = {
        let mut driver = Standalone::new(family()?);
        driver.add(ok()?);
        driver.run_until_done(10_000)?;
        let (tokens, failed) = outcome(&driver, 0);
        ensure!(failed.is_none(), "the request fails alone: {failed:?}");
        tokens
    };
    ensure!(!alone.is_empty(), "the request streams nothing alone");
    for fault in [Fault::Plan, Fault::Forward, Fault::Commit] {
        let mut driver = Standalone::new(Faulty::new(family()?, RequestId(0), fault, 2));
        driver.add(faulty()?);
        driver.add(ok()?);
        driver.run_until_done(10_000)?;
        match outcome(&driver, 0).1 {
            Some(EngineError::StepFailed(e)) if e.to_string().contains(&format!("{fault:?}")) => {
                let typed = e.cause().and_then(|c| c.downcast_ref::<Injected>());
                ensure!(
                    typed.is_some_and(|i| i.0 == fault),
                    "{fault:?}: cause {e:?}"
                );
            }
            other => bail!("{fault:?}: the faulty request ended with {other:?}"),
        }
        let (tokens, failed) = outcome(&driver, 1);
        ensure!(
            failed.is_none(),
            "{fault:?}: the other request failed: {failed:?}"
        );
        ensure!(
            tokens == alone,
            "{fault:?}: the other request streamed {tokens:?}, alone {alone:?}"
        );
    }
    Ok(())
}
