//! Prompt sharing in the scheduler, with a fake family: a request whose prompt a running request
//! is computing waits for it in its place (the requests behind it go ahead), then is admitted
//! onto that request's pages (each shared slot counted with both holders, only the rest
//! allocated); a donor that fails or leaves before its prompt is done holds nobody up; every
//! slot is free once both requests are gone.

use std::sync::mpsc;
use std::time::Instant;

use wavefront_engine::scheduler::{Scheduler, Waiting};
use wavefront_engine::{
    Active, Demand, Event, Family, FamilyError, FinishReason, Group, Planned, Prepared, RequestId,
    SlotId, Stats,
};

/// A request whose first `prompt` ticks compute its prompt, which then emits until `len`
/// ticks; `fail_at` fails it at that tick.
struct Program {
    key: Option<u64>,
    prompt: usize,
    len: usize,
    ticks: usize,
    fail_at: Option<usize>,
    /// Slots it read from another request.
    shared: Vec<SlotId>,
}

/// Shares the first two slots of a donor whose prompt is done.
struct Sharing;

impl Family for Sharing {
    type Program = Program;
    type Plan = ();
    type Output = ();

    fn demand(&self, _a: &Active<Program>) -> Demand {
        Demand::Whole(1)
    }

    fn plan(&mut self, _a: &mut Active<Program>, _rows: usize) -> Result<Option<()>, FamilyError> {
        Ok(Some(()))
    }

    fn run(&mut self, work: &mut [Planned<'_, Program, ()>]) -> Vec<Group<()>> {
        vec![Group::all(work.len(), Ok(vec![(); work.len()]))]
    }

    fn commit(&mut self, a: &mut Active<Program>, _: (), _: ()) -> Result<(), FamilyError> {
        let p = &mut a.program;
        if p.fail_at == Some(p.ticks) {
            return Err(FamilyError::commit(
                "sharing",
                std::io::Error::other("injected failure"),
            ));
        }
        p.ticks += 1;
        if p.ticks >= p.len {
            a.outbox.finish(FinishReason::Length, Stats::default());
        }
        Ok(())
    }

    fn share_key(&self, p: &Program) -> Option<u64> {
        p.key
    }

    fn prompt_pending(&self, a: &Active<Program>) -> bool {
        a.program.ticks < a.program.prompt
    }

    fn adopt_prompt(
        &mut self,
        donor: &mut Active<Program>,
        taker: &mut Active<Program>,
    ) -> Result<Vec<SlotId>, FamilyError> {
        let shared: Vec<SlotId> = donor.slots[..2].to_vec();
        taker.program.shared = shared.clone();
        taker.program.ticks = taker.program.prompt;
        Ok(shared)
    }
}

fn waiting(id: u64, program: Program) -> (Waiting<Program>, mpsc::Receiver<Event>) {
    let (tx, rx) = mpsc::sync_channel(64);
    (
        Waiting {
            id: RequestId(id),
            prepared: Prepared::reserved(program, 4, 8),
            sink: Box::new(tx),
            deadline: None,
            submitted_at: Instant::now(),
            span: tracing::Span::none(),
        },
        rx,
    )
}

fn program(key: Option<u64>, fail_at: Option<usize>) -> Program {
    Program {
        key,
        prompt: 3,
        len: 6,
        ticks: 0,
        fail_at,
        shared: Vec::new(),
    }
}

fn ended(rx: &mpsc::Receiver<Event>) -> bool {
    rx.try_iter()
        .any(|e| matches!(e, Event::Finished { .. } | Event::Failed(_)))
}

#[test]
fn a_request_waits_for_the_prompt_pages_it_shares_and_holds_only_the_rest() {
    let mut s: Scheduler<Program> = Scheduler::new(16, 8, 8);
    let mut f = Sharing;
    let (a, rx_a) = waiting(1, program(Some(7), None));
    let (b, rx_b) = waiting(2, program(Some(7), None));
    let (c, rx_c) = waiting(3, program(Some(8), None));
    for w in [a, b, c] {
        assert!(s.enqueue(w).is_ok());
    }
    // The donor computes its prompt; the request with its key waits in its place, and the one
    // behind it, another prompt, goes ahead.
    for _ in 0..3 {
        s.tick(&mut f, Instant::now());
        assert_eq!(s.running(), 2);
        assert_eq!(s.queued(), 1);
        assert_eq!(s.pool().used(), 4 + 4);
    }
    // Prompt done: the second reads its first two slots and takes two more.
    s.tick(&mut f, Instant::now());
    assert_eq!(s.running(), 3);
    assert_eq!(s.pool().used(), 4 + 4 + 2);
    assert_eq!(s.pool().shared(), 2);
    let (mut done_a, mut done_b, mut done_c) = (false, false, false);
    for _ in 0..20 {
        s.tick(&mut f, Instant::now());
        done_a |= ended(&rx_a);
        done_b |= ended(&rx_b);
        done_c |= ended(&rx_c);
    }
    assert!(done_a && done_b && done_c);
    assert_eq!(s.pool().free(), 16);
    assert_eq!(s.pool().shared(), 0);
}

#[test]
fn a_donor_that_fails_before_its_prompt_is_done_holds_nobody_up() {
    let mut s: Scheduler<Program> = Scheduler::new(16, 8, 8);
    let mut f = Sharing;
    let (a, rx_a) = waiting(1, program(Some(7), Some(1)));
    let (b, rx_b) = waiting(2, program(Some(7), None));
    assert!(s.enqueue(a).is_ok());
    assert!(s.enqueue(b).is_ok());
    let (mut done_a, mut done_b) = (false, false);
    for _ in 0..20 {
        s.tick(&mut f, Instant::now());
        done_a |= ended(&rx_a);
        done_b |= ended(&rx_b);
    }
    assert!(done_a && done_b, "the waiting request ran on its own");
    assert_eq!(s.pool().free(), 16);
}
