//! Whole ticks on fake outputs: the row budget shared between plans, outputs routed to their
//! programs, and failures of a plan, a forward group or a commit confined to the requests in
//! them, with no model in the loop.

use std::collections::BTreeMap;
use wavefront_engine::{
    run_tick, Active, Demand, Event, Family, FamilyError, FinishReason, Group, Planned, RequestId,
    Stats,
};

/// What a fake program asks for and how it fails.
#[derive(Debug, Clone, Default)]
struct Script {
    /// Rows left of its prompt (a prefill that may run in part), then one row per step.
    prompt: usize,
    /// Its forward group (the family runs one group per distinct value).
    group: u8,
    fail_plan: bool,
    fail_commit: bool,
    /// Steps after its prompt before it finishes.
    steps: usize,
    /// Rows each step planned, in order.
    planned: Vec<usize>,
}

/// Runs each group's plans; the output of a plan is its rows times 10 plus its group.
#[derive(Default)]
struct FakeFamily {
    /// Groups whose forward fails.
    failing: Vec<u8>,
    /// A group whose output the family forgets.
    forgets: Option<u8>,
    runs: usize,
}

fn injected(what: &str) -> std::io::Error {
    std::io::Error::other(format!("injected {what}"))
}

impl Family for FakeFamily {
    type Program = Script;
    type Plan = usize;
    type Output = usize;

    fn demand(&self, a: &Active<Script>) -> Demand {
        if a.program.prompt > 0 {
            Demand::Prefill(a.program.prompt)
        } else {
            Demand::Whole(1)
        }
    }

    fn plan(&mut self, a: &mut Active<Script>, rows: usize) -> Result<Option<usize>, FamilyError> {
        if a.program.fail_plan {
            return Err(FamilyError::program(
                "fake",
                wavefront_engine::Phase::Plan,
                injected("plan failure"),
            ));
        }
        a.program.planned.push(rows);
        Ok(Some(rows))
    }

    fn run(&mut self, work: &mut [Planned<'_, Script, usize>]) -> Vec<Group<usize>> {
        self.runs += 1;
        let mut groups: BTreeMap<u8, Vec<usize>> = BTreeMap::new();
        for (i, w) in work.iter().enumerate() {
            groups.entry(w.program.group).or_default().push(i);
        }
        groups
            .into_iter()
            .filter(|(g, _)| self.forgets != Some(*g))
            .map(|(g, members)| {
                let outputs = if self.failing.contains(&g) {
                    Err(FamilyError::forward(injected("forward failure")))
                } else {
                    // Reversed, to check outputs follow `members`, not the tick's order.
                    let mut m = members.clone();
                    m.reverse();
                    let outs = m.iter().map(|&i| work[i].plan * 10 + g as usize).collect();
                    return Group {
                        members: m,
                        outputs: Ok(outs),
                    };
                };
                Group { members, outputs }
            })
            .collect()
    }

    fn commit(
        &mut self,
        a: &mut Active<Script>,
        plan: usize,
        out: usize,
    ) -> Result<(), FamilyError> {
        let p = &mut a.program;
        assert_eq!(
            out,
            plan * 10 + p.group as usize,
            "an output reached the wrong program"
        );
        if p.fail_commit {
            return Err(FamilyError::commit("fake", injected("commit failure")));
        }
        if p.prompt > 0 {
            p.prompt -= plan;
            return Ok(());
        }
        a.outbox.tokens(vec![out as u32]);
        p.steps -= 1;
        if p.steps == 0 {
            a.outbox.finish(FinishReason::Length, Stats::default());
        }
        Ok(())
    }
}

fn actives(scripts: &[Script]) -> Vec<Active<Script>> {
    scripts
        .iter()
        .enumerate()
        .map(|(i, s)| Active::new(RequestId(i as u64), s.clone()))
        .collect()
}

fn tick(family: &mut FakeFamily, all: &mut [Active<Script>], budget: Option<usize>) {
    let mut batch: Vec<&mut Active<Script>> =
        all.iter_mut().filter(|a| !a.outbox.is_done()).collect();
    run_tick(family, &mut batch, budget);
}

fn failed(a: &Active<Script>) -> Option<&FamilyError> {
    a.outbox.events().iter().find_map(|e| match e {
        Event::Failed(wavefront_engine::EngineError::StepFailed(f)) => Some(f),
        _ => None,
    })
}

#[test]
fn prefills_share_the_rows_the_decoding_steps_leave_in_tick_order() {
    let decode = Script {
        steps: 5,
        ..Script::default()
    };
    let prefill = Script {
        prompt: 20,
        steps: 1,
        ..Script::default()
    };
    let mut all = actives(&[prefill.clone(), decode.clone(), decode, prefill]);
    let mut family = FakeFamily::default();
    tick(&mut family, &mut all, Some(16));
    // 2 decoding rows run whole; the first prefill takes the other 14, the second waits.
    assert_eq!(all[0].program.planned, [14]);
    assert_eq!(
        (
            all[1].program.planned.clone(),
            all[2].program.planned.clone()
        ),
        (vec![1], vec![1])
    );
    assert!(all[3].program.planned.is_empty());
    tick(&mut family, &mut all, Some(16));
    // The first prefill's last 6 rows, then the second gets the rest.
    assert_eq!(all[0].program.planned, [14, 6]);
    assert_eq!(all[3].program.planned, [8]);
    // Without a budget every prefill runs whole.
    let big = Script {
        prompt: 50,
        steps: 1,
        ..Script::default()
    };
    let mut all = actives(&[big.clone(), big]);
    tick(&mut family, &mut all, None);
    assert_eq!(
        (
            all[0].program.planned.clone(),
            all[1].program.planned.clone()
        ),
        (vec![50], vec![50])
    );
}

#[test]
fn a_failed_forward_group_fails_only_its_requests() {
    let ok = Script {
        steps: 2,
        group: 0,
        ..Script::default()
    };
    let doomed = Script {
        steps: 2,
        group: 1,
        ..Script::default()
    };
    let mut all = actives(&[ok.clone(), doomed.clone(), ok, doomed]);
    let mut family = FakeFamily {
        failing: vec![1],
        ..FakeFamily::default()
    };
    tick(&mut family, &mut all, None);
    tick(&mut family, &mut all, None);
    for i in [0, 2] {
        assert!(failed(&all[i]).is_none());
        assert!(matches!(
            all[i].outbox.events().last(),
            Some(Event::Finished {
                reason: FinishReason::Length,
                ..
            })
        ));
    }
    for i in [1, 3] {
        let f = failed(&all[i]).expect("the failing group's requests fail");
        assert!(matches!(f, FamilyError::Forward(_)) && f.to_string().contains("forward failure"));
        assert_eq!(all[i].outbox.events().len(), 1, "nothing but the failure");
    }
}

#[test]
fn a_failed_plan_or_commit_fails_only_its_own_request() {
    let ok = Script {
        steps: 1,
        ..Script::default()
    };
    let mut all = actives(&[
        Script {
            fail_plan: true,
            ..ok.clone()
        },
        ok.clone(),
        Script {
            fail_commit: true,
            ..ok.clone()
        },
    ]);
    let mut family = FakeFamily::default();
    tick(&mut family, &mut all, None);
    assert!(matches!(
        failed(&all[0]),
        Some(FamilyError::Program {
            phase: wavefront_engine::Phase::Plan,
            ..
        })
    ));
    assert!(failed(&all[1]).is_none() && all[1].outbox.is_done());
    assert_eq!(all[1].outbox.events()[0], Event::Tokens(vec![10]));
    assert!(matches!(
        failed(&all[2]),
        Some(FamilyError::Program {
            phase: wavefront_engine::Phase::Commit,
            ..
        })
    ));
}

#[test]
fn a_plan_the_family_gives_no_output_fails_instead_of_waiting_forever() {
    let mut all = actives(&[
        Script {
            steps: 3,
            group: 0,
            ..Script::default()
        },
        Script {
            steps: 3,
            group: 2,
            ..Script::default()
        },
    ]);
    let mut family = FakeFamily {
        forgets: Some(2),
        ..FakeFamily::default()
    };
    tick(&mut family, &mut all, None);
    assert!(failed(&all[0]).is_none());
    assert!(matches!(
        failed(&all[1]),
        Some(FamilyError::NoOutput { .. })
    ));
}
