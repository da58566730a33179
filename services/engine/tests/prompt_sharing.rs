//! Prompt sharing in the scheduler, with a fake family: a request whose prompt a running request
//! is computing waits for it in its place (the requests behind it go ahead), then is admitted
//! onto that request's pages (each shared slot counted with both holders, only the rest
//! allocated); a donor that fails or leaves before its prompt is done holds nobody up; every
//! slot is free once both requests are gone. The prefix cache keeps a finished request's slots
//! for a later request with its key, and gives them back before the pool refuses or preempts
//! anyone.

use std::sync::mpsc;
use std::time::Instant;

use metrics_util::debugging::{DebugValue, DebuggingRecorder, Snapshotter};
use wavefront_engine::scheduler::{Scheduler, Waiting};
use wavefront_engine::{
    Active, Adopted, Demand, Event, Family, FamilyError, FinishReason, Group, Planned, Prepared,
    RequestId, SlotId, Stats,
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
    /// Prompts of one group begin alike: they share their first slot (one tick of prompt).
    group: Option<u64>,
}

/// Shares the first two slots of a donor whose prompt is done; a taker whose prompt is one tick
/// long shares nothing (as a taker that has already run shares nothing).
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

    fn prefix_rows(&self, donor: &Active<Program>, taker: &Active<Program>) -> usize {
        let (d, t) = (&donor.program, &taker.program);
        let alike = d.group.is_some() && d.group == t.group && d.key != t.key;
        usize::from(alike && d.ticks >= d.prompt && t.ticks == 0)
    }

    fn adopt_prompt(
        &mut self,
        donor: &mut Active<Program>,
        taker: &mut Active<Program>,
    ) -> Result<Adopted, FamilyError> {
        if taker.program.prompt < 2 {
            return Ok(Adopted::default());
        }
        let (n, ticks) = match self.prefix_rows(donor, taker) {
            0 => (2, taker.program.prompt),
            rows => (rows, rows),
        };
        let shared: Vec<SlotId> = donor.slots[..n].to_vec();
        taker.program.shared = shared.clone();
        taker.program.ticks = ticks;
        Ok(Adopted {
            slots: shared,
            rows: ticks,
        })
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
        group: None,
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
    // The donor and the other prompt stay in the prefix cache (the taker's key is the donor's):
    // their slots count as free.
    assert_eq!(s.cached_prompts(), 2);
    assert_eq!(s.pool().free(), 16 - 8);
    assert_eq!(s.available(), 16);
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
    // A failed request is never kept; the one that ran on its own is.
    assert_eq!(s.cached_prompts(), 1);
    assert_eq!(s.available(), 16);
}

/// Runs `s` until every receiver saw its request end.
fn run_until_ended(s: &mut Scheduler<Program>, f: &mut Sharing, rxs: &[&mpsc::Receiver<Event>]) {
    let mut ended_yet = vec![false; rxs.len()];
    for _ in 0..50 {
        s.tick(f, Instant::now());
        for (e, rx) in ended_yet.iter_mut().zip(rxs) {
            *e |= ended(rx);
        }
        if ended_yet.iter().all(|&e| e) {
            return;
        }
    }
    panic!("requests still running: {ended_yet:?}");
}

#[test]
fn a_later_request_reads_the_prompt_pages_a_finished_one_left_in_the_prefix_cache() {
    let mut s: Scheduler<Program> = Scheduler::new(16, 8, 8);
    let mut f = Sharing;
    let (a, rx_a) = waiting(1, program(Some(7), None));
    assert!(s.enqueue(a).is_ok());
    run_until_ended(&mut s, &mut f, &[&rx_a]);
    assert_eq!(s.cached_prompts(), 1);
    assert_eq!((s.pool().used(), s.cached_slots()), (4, 4));
    // Admitted onto the cached pages at once: it holds two of them with the cache and two of
    // its own, and skips its prompt (three ticks to its end, not six).
    let (b, rx_b) = waiting(2, program(Some(7), None));
    assert!(s.enqueue(b).is_ok());
    s.tick(&mut f, Instant::now());
    assert_eq!(s.running(), 1);
    assert_eq!(s.pool().used(), 4 + 2);
    assert_eq!(s.pool().shared(), 2);
    // Only the cache's two slots it does not share are free to take back.
    assert_eq!(s.cached_slots(), 2);
    let mut ticks = 1;
    while !ended(&rx_b) {
        s.tick(&mut f, Instant::now());
        ticks += 1;
        assert!(ticks < 10, "the taker did not end");
    }
    assert_eq!(ticks, 3);
    // One entry per key: the taker is not kept, and its slots are free.
    assert_eq!(s.cached_prompts(), 1);
    assert_eq!((s.pool().used(), s.pool().shared()), (4, 0));
}

#[test]
fn the_prefix_cache_gives_its_slots_back_before_anyone_is_refused_or_preempted() {
    let mut s: Scheduler<Program> = Scheduler::new(16, 8, 8);
    let mut f = Sharing;
    // Four prompts finish one after the other and fill the pool's sixteen slots with cache
    // entries.
    for i in 0..4 {
        let (w, rx) = waiting(i, program(Some(100 + i), None));
        assert!(s.enqueue(w).is_ok());
        run_until_ended(&mut s, &mut f, &[&rx]);
    }
    assert_eq!(s.cached_prompts(), 4);
    assert_eq!((s.pool().free(), s.available()), (0, 16));
    // Three new prompts are admitted at once: the three least recently used entries go.
    let rxs: Vec<_> = (10..13)
        .map(|i| {
            let (w, rx) = waiting(i, program(Some(i), None));
            assert!(s.enqueue(w).is_ok());
            rx
        })
        .collect();
    s.tick(&mut f, Instant::now());
    assert_eq!(s.running(), 3);
    assert_eq!(s.cached_prompts(), 1);
    // The newest entry is the one kept: a request with its key reads its pages, and the entry
    // then goes too (the taker's own two slots needed it), leaving the pages to the taker,
    // which skips its prompt: it ends after three ticks, before the others.
    let (w, rx) = waiting(20, program(Some(103), None));
    assert!(s.enqueue(w).is_ok());
    s.tick(&mut f, Instant::now());
    assert_eq!(s.running(), 4);
    assert_eq!(
        (s.cached_prompts(), s.pool().free(), s.pool().shared()),
        (0, 0, 0)
    );
    s.tick(&mut f, Instant::now());
    s.tick(&mut f, Instant::now());
    assert!(ended(&rx));
    assert!(!rxs.iter().any(ended));
    run_until_ended(&mut s, &mut f, &rxs.iter().collect::<Vec<_>>());
    assert_eq!(s.preemptions(), 0);
    assert_eq!(s.available(), 16);
}

#[test]
fn the_prefix_cache_keeps_at_most_its_entries_and_can_be_switched_off() {
    for (entries, kept) in [(2, 2), (0, 0)] {
        let mut s: Scheduler<Program> = Scheduler::new(16, 8, 8).with_prefix_cache(entries);
        let mut f = Sharing;
        let rxs: Vec<_> = (0..3)
            .map(|i| {
                let (w, rx) = waiting(i, program(Some(100 + i), None));
                assert!(s.enqueue(w).is_ok());
                rx
            })
            .collect();
        run_until_ended(&mut s, &mut f, &rxs.iter().collect::<Vec<_>>());
        assert_eq!(s.cached_prompts(), kept);
        assert_eq!(s.pool().used(), 4 * kept);
        assert_eq!(s.available(), 16);
    }
    // Without prompt sharing nothing is kept either.
    let mut s: Scheduler<Program> = Scheduler::new(16, 8, 8).with_prompt_sharing(false);
    let (w, rx) = waiting(1, program(Some(7), None));
    assert!(s.enqueue(w).is_ok());
    run_until_ended(&mut s, &mut Sharing, &[&rx]);
    assert_eq!((s.cached_prompts(), s.pool().free()), (0, 16));
}

#[test]
fn a_request_that_needs_the_whole_pool_is_admitted_once_the_prefix_cache_lets_go() {
    let mut s: Scheduler<Program> = Scheduler::new(8, 8, 8);
    let mut f = Sharing;
    let (a, rx_a) = waiting(1, program(Some(7), None));
    assert!(s.enqueue(a).is_ok());
    run_until_ended(&mut s, &mut f, &[&rx_a]);
    assert_eq!((s.cached_prompts(), s.pool().free()), (1, 4));
    // A request that needs all eight slots is admitted: the entry goes.
    let (tx, rx) = mpsc::sync_channel(64);
    let big = Waiting {
        id: RequestId(2),
        prepared: Prepared::reserved(program(None, None), 8, 8),
        sink: Box::new(tx),
        deadline: None,
        submitted_at: Instant::now(),
        span: tracing::Span::none(),
    };
    assert!(s.enqueue(big).is_ok());
    s.tick(&mut f, Instant::now());
    assert_eq!(s.running(), 1);
    assert_eq!((s.cached_prompts(), s.pool().free()), (0, 0));
    run_until_ended(&mut s, &mut f, &[&rx]);
    assert_eq!(s.preemptions(), 0);
}

#[test]
fn a_request_whose_prompt_only_begins_alike_reads_the_longest_common_prefix() {
    let mut s: Scheduler<Program> = Scheduler::new(16, 8, 8);
    let mut f = Sharing;
    let grouped = |key, group| Program {
        group: Some(group),
        ..program(Some(key), None)
    };
    // A running donor: the taker reads its first slot and skips one tick of its prompt.
    let (a, rx_a) = waiting(1, grouped(7, 1));
    assert!(s.enqueue(a).is_ok());
    for _ in 0..3 {
        s.tick(&mut f, Instant::now());
    }
    let (b, rx_b) = waiting(2, grouped(8, 1));
    assert!(s.enqueue(b).is_ok());
    s.tick(&mut f, Instant::now());
    assert_eq!(
        (s.running(), s.pool().used(), s.pool().shared()),
        (2, 4 + 3, 1)
    );
    run_until_ended(&mut s, &mut f, &[&rx_a, &rx_b]);
    // Both are kept (their whole prompts differ); a third of the group reads the most recently
    // used of them, another group nothing.
    assert_eq!(s.cached_prompts(), 2);
    let (c, rx_c) = waiting(3, grouped(9, 1));
    let (d, rx_d) = waiting(4, grouped(10, 2));
    assert!(s.enqueue(c).is_ok());
    assert!(s.enqueue(d).is_ok());
    s.tick(&mut f, Instant::now());
    assert_eq!(s.running(), 2);
    assert_eq!(s.pool().shared(), 1);
    // The taker ends after five ticks of six, the other after six.
    for _ in 0..4 {
        s.tick(&mut f, Instant::now());
    }
    assert!(ended(&rx_c));
    assert!(!ended(&rx_d));
    run_until_ended(&mut s, &mut f, &[&rx_d]);
    assert_eq!(s.available(), 16);
}

/// The counters `names` in one snapshot of `snapshotter`'s recorder (a snapshot resets them);
/// 0 for one never touched.
fn counters<const N: usize>(snapshotter: &Snapshotter, names: [&str; N]) -> [u64; N] {
    let all = snapshotter.snapshot().into_vec();
    names.map(|name| {
        all.iter()
            .find_map(|(key, _, _, value)| match value {
                DebugValue::Counter(n) if key.key().name() == name => Some(*n),
                _ => None,
            })
            .unwrap_or(0)
    })
}

#[test]
fn a_prefix_cache_hit_is_an_adoption_that_reads_rows_and_counts_them() {
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    let mut s: Scheduler<Program> =
        metrics::with_local_recorder(&recorder, || Scheduler::new(16, 8, 8).with_label("fake"));
    let mut f = Sharing;
    // A one-tick prompt is kept, and its repeat adopts the entry but reads nothing: no hit.
    // A three-tick prompt's repeat reads its three rows: one hit of three tokens.
    for (id, key, prompt) in [(1, 11, 1), (2, 11, 1), (3, 13, 3), (4, 13, 3)] {
        let (w, rx) = waiting(
            id,
            Program {
                prompt,
                ..program(Some(key), None)
            },
        );
        assert!(s.enqueue(w).is_ok());
        run_until_ended(&mut s, &mut f, &[&rx]);
    }
    assert_eq!(s.cached_prompts(), 2);
    let got = counters(
        &snapshotter,
        [
            "wavefront_engine_prefix_cache_hits_total",
            "wavefront_engine_prefix_cache_hit_tokens_total",
        ],
    );
    assert_eq!(got, [1, 3]);
}
