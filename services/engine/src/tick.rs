//! The compute part of a tick, the same for every family: demand → row budget → plan → run →
//! commit (see [`crate::family`]). The scheduler calls [`run_tick`] with the programs that run;
//! so do tests and benchmarks that drive programs without a scheduler
//! ([`crate::standalone::Standalone`]).

use crate::error::FamilyError;
use crate::family::{Demand, Family, Planned};
use crate::request::Active;

/// What one tick's compute did.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct TickOutcome {
    /// Programs that planned a step.
    pub planned: usize,
    /// Rows the planned steps computed (their demands, or the part of a prefill they got).
    pub rows: usize,
    /// Forward groups the family ran.
    pub groups: usize,
    /// Programs failed by their plan, their group's forward or their commit.
    pub failed: usize,
}

/// Rows each prefill may run this tick under a row budget (`--max-batch-rows`): `whole` rows of
/// the tick are spoken for (steps that run whole), and each prefill in `wants` gets what is
/// left, in order, at most what it wants. Without a budget every prefill runs whole. A prefill
/// may get 0 (it waits for a later tick), except that when nothing else runs the first one
/// always gets at least one row.
pub fn share_rows(budget: Option<usize>, whole: usize, wants: &[usize]) -> Vec<usize> {
    let Some(budget) = budget else {
        return wants.to_vec();
    };
    let mut left = budget.saturating_sub(whole);
    let mut out = Vec::with_capacity(wants.len());
    for &want in wants {
        let mut take = want.min(left);
        if take == 0 && whole == 0 && out.iter().all(|&t| t == 0) && want > 0 {
            take = 1;
        }
        left -= take.min(left);
        out.push(take);
    }
    out
}

/// Rows each of `demands` runs this tick under `budget`: `None` for a program that does not
/// plan (idle, or a prefill the budget left nothing for).
pub fn grant_rows(demands: &[Demand], budget: Option<usize>) -> Vec<Option<usize>> {
    let whole: usize = demands
        .iter()
        .map(|d| match d {
            Demand::Whole(n) => *n,
            _ => 0,
        })
        .sum();
    let wants: Vec<usize> = demands
        .iter()
        .filter_map(|d| match d {
            Demand::Prefill(n) => Some(*n),
            _ => None,
        })
        .collect();
    let mut takes = share_rows(budget, whole, &wants).into_iter();
    demands
        .iter()
        .map(|d| match d {
            Demand::Idle => None,
            Demand::Whole(n) => Some(*n),
            Demand::Prefill(_) => takes.next().filter(|&t| t > 0),
        })
        .collect()
}

/// One tick's compute over `batch`, the programs that run: every program's demand, the row
/// budget `max_rows` shared between them, every plan, the family's packed forwards, every
/// commit. A failed plan or commit fails its request, a failed forward group its members, and
/// a planned program the family gave no output fails too (never left waiting).
pub fn run_tick<F: Family>(
    family: &mut F,
    batch: &mut [&mut Active<F::Program>],
    max_rows: Option<usize>,
) -> TickOutcome {
    let mut outcome = TickOutcome::default();
    let demands: Vec<Demand> = batch.iter().map(|a| family.demand(a)).collect();
    let grants = grant_rows(&demands, max_rows);

    // Plan.
    let mut planned: Vec<usize> = Vec::with_capacity(batch.len());
    let mut plans = Vec::with_capacity(batch.len());
    for (i, rows) in grants.iter().enumerate() {
        let Some(rows) = *rows else { continue };
        let a = &mut *batch[i];
        if a.outbox.is_done() {
            continue;
        }
        match family.plan(a, rows) {
            Ok(Some(plan)) => {
                planned.push(i);
                plans.push(plan);
                outcome.rows += rows;
            }
            Ok(None) => {}
            Err(error) => {
                tracing::warn!(request = %a.id, %error, "plan failed; failing the request");
                a.outbox.fail(error);
                outcome.failed += 1;
            }
        }
    }
    outcome.planned = planned.len();
    if planned.is_empty() {
        return outcome;
    }

    // Run.
    let (groups, plans) = {
        let mut work: Vec<Planned<'_, F::Program, F::Plan>> = Vec::with_capacity(planned.len());
        let mut plans = plans.into_iter();
        let mut next = planned.iter().peekable();
        for (i, a) in batch.iter_mut().enumerate() {
            if next.peek() == Some(&&i) {
                next.next();
                work.push(Planned {
                    program: &mut a.program,
                    plan: plans.next().expect("a plan per planned program"),
                });
            }
        }
        let groups = family.run(&mut work);
        let plans: Vec<Option<F::Plan>> = work.into_iter().map(|w| Some(w.plan)).collect();
        (groups, plans)
    };
    outcome.groups = groups.len();

    // Commit.
    let mut plans = plans;
    let mut answered = vec![false; planned.len()];
    for group in groups {
        let members: Vec<usize> = group
            .members
            .iter()
            .copied()
            .filter(|&m| m < planned.len() && !std::mem::replace(&mut answered[m], true))
            .collect();
        let outputs = match group.outputs {
            Ok(outs) if outs.len() == group.members.len() && members.len() == outs.len() => {
                Ok(outs)
            }
            Ok(_) => Err(FamilyError::NoOutput {
                family: std::any::type_name::<F>(),
            }),
            Err(e) => Err(e),
        };
        match outputs {
            Ok(outs) => {
                for (m, out) in members.into_iter().zip(outs) {
                    let a = &mut *batch[planned[m]];
                    let plan = plans[m].take().expect("each plan is committed once");
                    if let Err(error) = family.commit(a, plan, out) {
                        tracing::warn!(request = %a.id, %error, "commit failed; failing the request");
                        a.outbox.fail(error);
                        outcome.failed += 1;
                    }
                }
            }
            Err(error) => {
                tracing::warn!(%error, requests = members.len(), "forward failed; failing its requests");
                for m in members {
                    batch[planned[m]].outbox.fail(error.clone());
                    outcome.failed += 1;
                }
            }
        }
    }
    for (m, done) in answered.iter().enumerate() {
        if !done {
            let a = &mut *batch[planned[m]];
            a.outbox.fail(FamilyError::NoOutput {
                family: std::any::type_name::<F>(),
            });
            outcome.failed += 1;
        }
    }
    outcome
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefills_share_what_the_whole_steps_leave() {
        assert_eq!(share_rows(None, 5, &[100, 3]), [100, 3]);
        assert_eq!(share_rows(Some(64), 4, &[100, 3]), [60, 0]);
        assert_eq!(share_rows(Some(64), 4, &[10, 100]), [10, 50]);
        // Decoding alone over the budget: prefills wait.
        assert_eq!(share_rows(Some(8), 9, &[100]), [0]);
        // Nothing else runs: a prefill always moves.
        assert_eq!(share_rows(Some(0), 0, &[100]), [1]);
    }

    #[test]
    fn grants_follow_the_demands_in_tick_order() {
        let d = [
            Demand::Prefill(30),
            Demand::Whole(4),
            Demand::Idle,
            Demand::Prefill(30),
        ];
        assert_eq!(grant_rows(&d, Some(40)), [Some(30), Some(4), None, Some(6)]);
        assert_eq!(grant_rows(&d, Some(20)), [Some(16), Some(4), None, None]);
        assert_eq!(grant_rows(&d, None), [Some(30), Some(4), None, Some(30)]);
    }
}
