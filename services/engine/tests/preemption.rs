//! Slots granted as programs grow, and preemption when the pool is short, with a fake family
//! whose state really lives in the slots: a program's output depends on every value it stored,
//! so a slot lost, shared or mixed up in a move changes its tokens.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc};
use std::time::Instant;

use proptest::prelude::*;
use wavefront_engine::scheduler::{Scheduler, Waiting};
use wavefront_engine::{
    Active, Demand, Event, EventSink, Family, FamilyError, FinishReason, Group, Moved, Planned,
    Prepared, RequestId, SinkError, SlotId, Stats,
};

/// Values per slot (a page).
const PAGE: usize = 2;

/// Stores one value per tick; emits a token that hashes everything stored so far.
#[derive(Debug)]
struct Grower {
    seed: u64,
    len: usize,
    /// Slots the program writes, in order (its page table).
    table: Vec<SlotId>,
    spare: Vec<SlotId>,
    stored: usize,
    /// Values moved out while preempted.
    host: Option<Vec<u64>>,
}

impl Grower {
    fn need(&self) -> usize {
        (self.stored + 1).div_ceil(PAGE)
    }
}

#[derive(Default)]
struct PagedFamily {
    storage: HashMap<(SlotId, usize), u64>,
    /// Who holds each slot of the programs planned this tick.
    owners: HashMap<SlotId, RequestId>,
    preemptions: usize,
}

impl PagedFamily {
    fn take_new(a: &mut Active<Grower>) {
        let new = a.take_new_slots();
        a.program.spare.extend(new);
    }
}

impl Family for PagedFamily {
    type Program = Grower;

    type Plan = ();
    type Output = ();

    fn demand(&self, _a: &Active<Grower>) -> Demand {
        Demand::Whole(1)
    }

    fn plan(&mut self, a: &mut Active<Grower>, _rows: usize) -> Result<Option<()>, FamilyError> {
        Self::take_new(a);
        let p = &mut a.program;
        assert!(p.host.is_none(), "a swapped-out program ticked");
        if p.stored.is_multiple_of(PAGE) {
            let s = p.spare.pop().expect("the scheduler granted the next page");
            p.table.push(s);
        }
        for s in &a.slots {
            assert!(
                self.owners.insert(*s, a.id).is_none(),
                "slot {s} held twice"
            );
        }
        Ok(Some(()))
    }

    fn run(&mut self, work: &mut [Planned<'_, Grower, ()>]) -> Vec<Group<()>> {
        self.owners.clear();
        vec![Group::all(work.len(), Ok(vec![(); work.len()]))]
    }

    fn commit(&mut self, a: &mut Active<Grower>, _plan: (), _out: ()) -> Result<(), FamilyError> {
        let p = &mut a.program;
        let value = p.seed.wrapping_mul(31).wrapping_add(p.stored as u64);
        let slot = p.table[p.stored / PAGE];
        self.storage.insert((slot, p.stored % PAGE), value);
        p.stored += 1;
        let mut h = 0u64;
        for i in 0..p.stored {
            let v = self.storage[&(p.table[i / PAGE], i % PAGE)];
            h = h.wrapping_mul(1_000_003).wrapping_add(v);
        }
        a.outbox.tokens(vec![(h % 50_000) as u32]);
        if p.stored >= p.len {
            let mut stats = Stats::default();
            stats.add_counter("stored", p.stored as u64);
            a.outbox.finish(FinishReason::Length, stats);
        }
        Ok(())
    }

    fn slots_needed(&self, a: &Active<Grower>) -> usize {
        a.program.need()
    }

    fn preempt(&mut self, a: &mut Active<Grower>) -> Result<Moved, FamilyError> {
        let p = &mut a.program;
        let values: Vec<u64> = (0..p.stored)
            .map(|i| {
                self.storage
                    .remove(&(p.table[i / PAGE], i % PAGE))
                    .expect("stored")
            })
            .collect();
        let bytes = 8 * values.len() as u64;
        p.host = Some(values);
        p.table.clear();
        p.spare.clear();
        self.preemptions += 1;
        Ok(Moved {
            bytes,
            recomputed_rows: 0,
        })
    }

    fn resume(&mut self, a: &mut Active<Grower>) -> Result<Moved, FamilyError> {
        Self::take_new(a);
        let p = &mut a.program;
        let values = p.host.take().expect("swapped out");
        for (i, v) in values.iter().enumerate() {
            if i % PAGE == 0 {
                p.table.push(p.spare.pop().expect("granted"));
            }
            self.storage.insert((p.table[i / PAGE], i % PAGE), *v);
        }
        Ok(Moved {
            bytes: 8 * values.len() as u64,
            recomputed_rows: 0,
        })
    }
}

fn grower(seed: u64, len: usize) -> Prepared<Grower> {
    Prepared {
        program: Grower {
            seed,
            len,
            table: Vec::new(),
            spare: Vec::new(),
            stored: 0,
            host: None,
        },
        slots: 1,
        max_slots: len.div_ceil(PAGE),
        floor: 0,
        prompt_tokens: 1,
        carried: None,
    }
}

/// What a request received: its tokens, and how it ended.
#[derive(Debug, PartialEq)]
struct Outcome {
    tokens: Vec<u32>,
    /// The reason and the statistics that do not measure time.
    end: Result<(FinishReason, Stats), String>,
}

/// Runs `reqs` (seed, length, arrival step) on a pool of `total` slots; returns each request's
/// outcome, the family's preemptions and the steps taken.
fn run(total: usize, watermark: usize, reqs: &[(u64, usize, u64)]) -> (Vec<Outcome>, usize, u64) {
    let mut sched: Scheduler<Grower> = Scheduler::new(total, 64, 64).with_watermark(watermark);
    let mut family = PagedFamily::default();
    let mut rxs = Vec::new();
    let mut step = 0u64;
    loop {
        for (i, &(seed, len, at)) in reqs.iter().enumerate() {
            if at == step {
                let (tx, rx) = mpsc::sync_channel(4096);
                let w = Waiting {
                    id: RequestId(i as u64),
                    prepared: grower(seed, len),
                    sink: Box::new(tx),
                    deadline: None,
                    submitted_at: Instant::now(),
                    span: tracing::Span::none(),
                };
                assert!(sched.enqueue(w).is_ok());
                rxs.push(rx);
            }
        }
        sched.tick(&mut family, Instant::now());
        assert!(sched.pool().used() <= total);
        step += 1;
        if step > reqs.iter().map(|r| r.2).max().unwrap_or(0) && sched.is_idle() {
            break;
        }
        assert!(step < 100_000, "no progress");
    }
    assert_eq!(sched.pool().free(), total, "every slot came back");
    assert!(family.storage.is_empty() || family.storage.len() <= total * PAGE);
    let outcomes = rxs
        .iter()
        .map(|rx| {
            let mut tokens = Vec::new();
            let mut end = Err("no final event".to_string());
            while let Ok(ev) = rx.try_recv() {
                match ev {
                    Event::Tokens(t) => tokens.extend(t),
                    Event::Finished { reason, mut stats } => {
                        stats.queue_time = Default::default();
                        stats.compute_time = Default::default();
                        end = Ok((reason, stats));
                    }
                    Event::Failed(e) => end = Err(e.to_string()),
                    Event::Canvas(_)
                    | Event::Logprobs(_)
                    | Event::PromptLogprobs(_)
                    | Event::Parked => {}
                }
            }
            Outcome { tokens, end }
        })
        .collect();
    (outcomes, family.preemptions, step)
}

#[test]
fn sixteen_requests_on_a_few_pages_preempt_and_finish_with_the_tokens_of_a_roomy_pool() {
    let reqs: Vec<(u64, usize, u64)> = (0..16)
        .map(|i| (i * 7 + 1, 3 + (i as usize * 5) % 11, i % 3))
        .collect();
    let (roomy, none, _) = run(1000, 0, &reqs);
    assert_eq!(none, 0, "a roomy pool never preempts");
    let (tight, preemptions, _) = run(8, 1, &reqs);
    assert!(
        preemptions > 0,
        "eight slots for sixteen growing requests must preempt"
    );
    assert_eq!(tight, roomy);
    for o in &tight {
        assert!(matches!(o.end, Ok((FinishReason::Length, _))), "{o:?}");
    }
}

#[test]
fn admission_takes_the_first_step_not_the_worst_case() {
    let mut sched: Scheduler<Grower> = Scheduler::new(10, 64, 64);
    let mut family = PagedFamily::default();
    let mut keep = Vec::new();
    for i in 0..10 {
        let (tx, rx) = mpsc::sync_channel(4096);
        keep.push(rx);
        let w = Waiting {
            id: RequestId(i),
            // Worst case 10 slots each: a worst-case reservation would admit one.
            prepared: grower(i, 20),
            sink: Box::new(tx),
            deadline: None,
            submitted_at: Instant::now(),
            span: tracing::Span::none(),
        };
        assert!(sched.enqueue(w).is_ok());
    }
    let report = sched.tick(&mut family, Instant::now());
    assert_eq!(report.admitted, 10);
    assert_eq!(report.ticked, 10);
    assert_eq!(sched.pool().used(), 10);
}

#[test]
fn a_request_larger_than_the_pool_is_refused_at_submission() {
    let sched: Scheduler<Grower> = Scheduler::new(4, 8, 8);
    let (tx, _rx) = mpsc::sync_channel(4);
    let w = Waiting {
        id: RequestId(0),
        prepared: grower(1, 9),
        sink: Box::new(tx),
        deadline: None,
        submitted_at: Instant::now(),
        span: tracing::Span::none(),
    };
    let err = sched
        .shared_queue()
        .push(w, Instant::now())
        .err()
        .map(|e| e.1);
    assert!(
        matches!(
            err,
            Some(wavefront_engine::EngineError::TooLarge {
                needed: 5,
                total: 4
            })
        ),
        "{err:?}"
    );
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    /// Whatever the pool size, arrivals and lengths: every request finishes with the tokens and
    /// statistics of a run without pressure, and every slot comes back.
    #[test]
    fn preemption_never_changes_what_a_request_produces(
        total in 3usize..12,
        watermark in 0usize..2,
        reqs in proptest::collection::vec((0u64..1000, 1usize..6, 0u64..10), 1..20),
    ) {
        let reqs: Vec<(u64, usize, u64)> = reqs
            .into_iter()
            .map(|(seed, len, at)| (seed, len.min(total * PAGE), at))
            .collect();
        let (roomy, _, _) = run(1000, 0, &reqs);
        let (tight, _, _) = run(total, watermark, &reqs);
        prop_assert_eq!(tight, roomy);
    }
}

#[test]
fn a_preempted_request_whose_deadline_passes_leaves_and_the_other_finishes() {
    let t0 = Instant::now();
    let mut sched: Scheduler<Grower> = Scheduler::new(4, 8, 8);
    let mut family = PagedFamily::default();
    let mut rxs = Vec::new();
    for (i, deadline) in [
        (0u64, None),
        (1, Some(t0 + std::time::Duration::from_secs(60))),
    ] {
        let (tx, rx) = mpsc::sync_channel(64);
        rxs.push(rx);
        let w = Waiting {
            id: RequestId(i),
            prepared: grower(i, 8),
            sink: Box::new(tx),
            deadline,
            submitted_at: t0,
            span: tracing::Span::none(),
        };
        assert!(sched.enqueue(w).is_ok());
    }
    // Both grow; four slots hold one of them at its end: the newer one is preempted.
    let mut steps = 0;
    while sched.preempted() == 0 {
        sched.tick(&mut family, t0);
        steps += 1;
        assert!(steps < 20, "no preemption");
    }
    assert_eq!(sched.running(), 2);
    // Its deadline passes while it waits to resume.
    let late = t0 + std::time::Duration::from_secs(61);
    let report = sched.tick(&mut family, late);
    assert_eq!(report.expired, 1);
    assert_eq!(sched.preempted(), 0);
    while !sched.is_idle() {
        sched.tick(&mut family, late);
    }
    assert_eq!(sched.pool().free(), 4);
    let events: Vec<Vec<Event>> = rxs.iter().map(|rx| rx.try_iter().collect()).collect();
    assert!(matches!(
        events[0].last(),
        Some(Event::Finished {
            reason: FinishReason::Length,
            ..
        })
    ));
    assert!(matches!(
        events[1].last(),
        Some(Event::Failed(
            wavefront_engine::EngineError::DeadlineExceeded { .. }
        ))
    ));
}

#[test]
fn a_request_waits_for_slots_held_by_a_slow_reader_instead_of_failing() {
    let t0 = Instant::now();
    let run = |total: usize, slow: bool| -> Vec<Vec<Event>> {
        let mut sched: Scheduler<Grower> = Scheduler::new(total, 8, 8);
        let mut family = PagedFamily::default();
        let mut rxs = Vec::new();
        for (i, len, bound) in [(0u64, 1usize, if slow { 1 } else { 64 }), (1, 8, 64)] {
            let (tx, rx) = mpsc::sync_channel(bound);
            rxs.push(rx);
            let w = Waiting {
                id: RequestId(i),
                prepared: grower(i, len),
                sink: Box::new(tx),
                deadline: None,
                submitted_at: t0,
                span: tracing::Span::none(),
            };
            assert!(sched.enqueue(w).is_ok());
        }
        let mut events: Vec<Vec<Event>> = vec![Vec::new(), Vec::new()];
        for step in 0..200 {
            sched.tick(&mut family, t0);
            // The slow reader reads nothing for 40 steps, then everything.
            for (k, rx) in rxs.iter().enumerate() {
                if k == 1 || step > 40 {
                    events[k].extend(rx.try_iter());
                }
            }
            if sched.is_idle() {
                break;
            }
        }
        assert!(sched.is_idle(), "stalled");
        assert_eq!(sched.pool().free(), total);
        for (k, rx) in rxs.iter().enumerate() {
            events[k].extend(rx.try_iter());
        }
        events
    };
    let roomy = run(100, false);
    let tight = run(4, true);
    for (k, (got, want)) in tight.iter().zip(&roomy).enumerate() {
        let toks = |ev: &[Event]| -> Vec<u32> {
            ev.iter()
                .flat_map(|e| match e {
                    Event::Tokens(t) => t.clone(),
                    _ => Vec::new(),
                })
                .collect()
        };
        assert_eq!(toks(got), toks(want), "request {k}");
        assert!(
            matches!(
                got.last(),
                Some(Event::Finished {
                    reason: FinishReason::Length,
                    ..
                })
            ),
            "request {k}: {:?}",
            got.last()
        );
    }
}

/// Queues a grower on a sink of `capacity` events; returns its receiver.
fn submit(
    sched: &mut Scheduler<Grower>,
    id: u64,
    len: usize,
    capacity: usize,
) -> mpsc::Receiver<Event> {
    let (tx, rx) = mpsc::sync_channel(capacity);
    let w = Waiting {
        id: RequestId(id),
        prepared: grower(id + 1, len),
        sink: Box::new(tx),
        deadline: None,
        submitted_at: Instant::now(),
        span: tracing::Span::none(),
    };
    if let Err((_, e)) = sched.enqueue(w) {
        panic!("request {id} refused: {e}");
    }
    rx
}

/// The tokens a grower of `seed` and `len` streams alone, with room to spare.
fn alone(seed: u64, len: usize) -> Vec<u32> {
    let (out, _, _) = run(1000, 0, &[(seed, len, 0)]);
    out[0].tokens.clone()
}

/// Requests whose clients do not read hold their slots while paused; a new request that needs
/// them preempts the paused ones (their state to host memory), not itself, and finishes; the
/// paused ones resume once their clients read, with the tokens they make alone.
#[test]
fn a_new_request_preempts_requests_whose_clients_do_not_read() {
    let mut sched: Scheduler<Grower> = Scheduler::new(16, 64, 64);
    let mut family = PagedFamily::default();
    // Eight requests that stream into three-event buffers nobody reads: each pauses holding two
    // pages, and the eight fill the pool.
    let stalled: Vec<mpsc::Receiver<Event>> =
        (0..8).map(|i| submit(&mut sched, i, 30, 3)).collect();
    for _ in 0..6 {
        sched.tick(&mut family, Instant::now());
    }
    assert_eq!(
        sched.pool().free(),
        0,
        "the paused requests hold the whole pool"
    );
    // A new request that grows to six pages.
    let fresh = submit(&mut sched, 8, 12, 4096);
    let mut ticks = 0;
    let mut tokens = Vec::new();
    loop {
        sched.tick(&mut family, Instant::now());
        ticks += 1;
        let mut finished = false;
        while let Ok(ev) = fresh.try_recv() {
            match ev {
                Event::Tokens(t) => tokens.extend(t),
                Event::Finished { .. } => finished = true,
                other => panic!("the new request ended with {other:?}"),
            }
        }
        if finished {
            break;
        }
        assert!(ticks < 100, "the new request did not finish in 100 ticks");
    }
    assert_eq!(tokens, alone(9, 12));
    assert!(
        family.preemptions >= 3,
        "{} preemptions",
        family.preemptions
    );
    // The clients read again: every paused request resumes and ends with its own tokens.
    let mut got: Vec<Vec<u32>> = vec![Vec::new(); stalled.len()];
    let mut done = vec![false; stalled.len()];
    for _ in 0..10_000 {
        sched.tick(&mut family, Instant::now());
        for (i, rx) in stalled.iter().enumerate() {
            while let Ok(ev) = rx.try_recv() {
                match ev {
                    Event::Tokens(t) => got[i].extend(t),
                    Event::Finished { .. } => done[i] = true,
                    other => panic!("request {i} ended with {other:?}"),
                }
            }
        }
        if done.iter().all(|&d| d) {
            break;
        }
    }
    assert!(
        done.iter().all(|&d| d),
        "paused requests did not all finish"
    );
    for (i, tokens) in got.iter().enumerate() {
        assert_eq!(*tokens, alone(i as u64 + 1, 30), "request {i}");
    }
    assert!(sched.is_idle());
    assert_eq!(sched.pool().free(), 16, "every slot came back");
}

/// A client that leaves its events unread past the write timeout loses its request: it leaves
/// (counted as stalled) and its slots return, running or preempted.
#[test]
fn a_request_left_unread_past_the_write_timeout_is_cancelled() {
    let timeout = std::time::Duration::from_secs(30);
    let mut sched: Scheduler<Grower> = Scheduler::new(8, 64, 64).with_write_timeout(Some(timeout));
    let mut family = PagedFamily::default();
    let _unread = submit(&mut sched, 0, 12, 1);
    let reading = submit(&mut sched, 1, 6, 4096);
    for _ in 0..4 {
        sched.tick(&mut family, Instant::now());
    }
    assert!(sched.pool().used() > 0);
    // Before the timeout it is only paused.
    let report = sched.tick(&mut family, Instant::now() + timeout / 2);
    assert_eq!(report.stalled, 0);
    let report = sched.tick(&mut family, Instant::now() + timeout * 2);
    assert_eq!(report.stalled, 1);
    for _ in 0..20 {
        sched.tick(&mut family, Instant::now());
    }
    assert!(reading
        .try_iter()
        .any(|e| matches!(e, Event::Finished { .. })));
    assert!(sched.is_idle());
    assert_eq!(sched.pool().free(), 8, "every slot came back");
}

/// A sink whose client reads only while its gate is open (what it read waits in the channel).
struct Gated {
    tx: mpsc::SyncSender<Event>,
    open: Arc<AtomicBool>,
}

impl EventSink for Gated {
    fn try_send(&mut self, event: Event) -> Result<(), (SinkError, Event)> {
        if !self.open.load(Ordering::Relaxed) {
            return Err((SinkError::Full, event));
        }
        EventSink::try_send(&mut self.tx.clone(), event)
    }
    fn is_closed(&self) -> bool {
        false
    }
}

/// Queues a grower on a [`Gated`] sink; returns its receiver and its gate (open).
fn submit_gated(
    sched: &mut Scheduler<Grower>,
    id: u64,
    len: usize,
) -> (mpsc::Receiver<Event>, Arc<AtomicBool>) {
    let (tx, rx) = mpsc::sync_channel(4096);
    let open = Arc::new(AtomicBool::new(true));
    let w = Waiting {
        id: RequestId(id),
        prepared: grower(id + 1, len),
        sink: Box::new(Gated {
            tx,
            open: open.clone(),
        }),
        deadline: None,
        submitted_at: Instant::now(),
        span: tracing::Span::none(),
    };
    if let Err((_, e)) = sched.enqueue(w) {
        panic!("request {id} refused: {e}");
    }
    (rx, open)
}

/// Every place taken, a preempted request whose client reads again waits for one; when an
/// older running request's client then stops reading, that request gives its place to the
/// waiting one. (The engine once looped for ever here: the request it had just preempted went
/// into the waiting list ahead of the one it meant to resume, and it resumed that one instead,
/// which it then preempted again, and so on, within one tick.)
#[test]
fn a_place_given_up_by_a_paused_request_goes_to_the_preempted_one_waiting() {
    let (done_tx, done_rx) = mpsc::channel();
    // The scenario runs on its own thread so that a regression fails here instead of hanging.
    std::thread::spawn(move || {
        let mut sched: Scheduler<Grower> = Scheduler::new(100, 64, 2);
        let mut family = PagedFamily::default();
        let (rx_a, gate_a) = submit_gated(&mut sched, 0, 40);
        let (rx_b, gate_b) = submit_gated(&mut sched, 1, 40);
        for _ in 0..3 {
            sched.tick(&mut family, Instant::now());
        }
        // B's client stops reading; C arrives and takes B's place (B is preempted, paused).
        gate_b.store(false, Ordering::Relaxed);
        sched.tick(&mut family, Instant::now());
        let rx_c = submit(&mut sched, 2, 40, 4096);
        sched.tick(&mut family, Instant::now());
        assert_eq!(sched.preempted(), 1, "B gave its place to C");
        // B's client reads again: B waits for a place, every place taken.
        gate_b.store(true, Ordering::Relaxed);
        for _ in 0..2 {
            sched.tick(&mut family, Instant::now());
        }
        assert_eq!(sched.preempted(), 1, "B waits for a place");
        // A's client stops reading: A gives its place to B.
        gate_a.store(false, Ordering::Relaxed);
        for _ in 0..3 {
            sched.tick(&mut family, Instant::now());
        }
        gate_a.store(true, Ordering::Relaxed);
        for _ in 0..1000 {
            if sched.is_idle() {
                break;
            }
            sched.tick(&mut family, Instant::now());
        }
        assert!(sched.is_idle(), "requests left after 1000 ticks");
        for (i, rx) in [rx_a, rx_b, rx_c].iter().enumerate() {
            let tokens: Vec<u32> = rx
                .try_iter()
                .flat_map(|e| match e {
                    Event::Tokens(t) => t,
                    _ => Vec::new(),
                })
                .collect();
            assert_eq!(tokens, alone(i as u64 + 1, 40), "request {i}");
        }
        assert!(
            family.preemptions >= 2,
            "{} preemptions",
            family.preemptions
        );
        done_tx.send(()).expect("the test waits");
    });
    done_rx
        .recv_timeout(std::time::Duration::from_secs(60))
        .expect("the scenario ends within 60 s (a panic above says why it ended early)");
}
