//! Behaviour of the scheduler and the engine thread with a fake family:
//! slot accounting under finishes, failures, cancellations and deadlines.

use proptest::prelude::*;
use std::collections::HashSet;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::sync::Arc;
use std::time::{Duration, Instant};
use wavefront_engine::scheduler::{Scheduler, Waiting};
use wavefront_engine::{
    Active, Demand, Engine, EngineConfig, EngineError, Event, EventSink, Family, FamilyError,
    FinishReason, Group, Planned, Prepared, RequestId, SinkError, SlotId, Stats, Submission,
};

/// Emits one token per tick until `len` tokens, or fails at tick `fail_at`.
struct Countdown {
    len: usize,
    emitted: usize,
    fail_at: Option<usize>,
}

#[derive(Default)]
struct FakeFamily {
    /// Every slot seen in one tick, to check no two programs share one.
    max_batch: usize,
    fail_whole_tick_at: Option<u64>,
    ticks: u64,
    /// Slots of the programs planned this tick.
    seen: HashSet<SlotId>,
}

fn injected(what: &str) -> std::io::Error {
    std::io::Error::other(format!("injected {what}"))
}

impl Family for FakeFamily {
    type Program = Countdown;
    type Plan = usize;
    type Output = u32;

    fn demand(&self, _a: &Active<Countdown>) -> Demand {
        Demand::Whole(1)
    }

    fn plan(
        &mut self,
        a: &mut Active<Countdown>,
        _rows: usize,
    ) -> Result<Option<usize>, FamilyError> {
        for s in &a.slots {
            assert!(
                self.seen.insert(*s),
                "slot {s} shared by two programs in one tick"
            );
        }
        Ok(Some(a.program.emitted))
    }

    fn run(&mut self, work: &mut [Planned<'_, Countdown, usize>]) -> Vec<Group<u32>> {
        self.ticks += 1;
        self.seen.clear();
        self.max_batch = self.max_batch.max(work.len());
        if self.fail_whole_tick_at == Some(self.ticks) {
            return vec![Group::all(
                work.len(),
                Err(FamilyError::forward(injected("device failure"))),
            )];
        }
        vec![Group::all(
            work.len(),
            Ok(work.iter().map(|w| w.plan as u32).collect()),
        )]
    }

    fn commit(
        &mut self,
        a: &mut Active<Countdown>,
        _plan: usize,
        token: u32,
    ) -> Result<(), FamilyError> {
        let p = &mut a.program;
        if p.fail_at == Some(p.emitted) {
            return Err(FamilyError::commit(
                "countdown",
                injected("program failure"),
            ));
        }
        a.outbox.tokens(vec![token]);
        p.emitted += 1;
        if p.emitted >= p.len {
            a.outbox.finish(FinishReason::Length, Stats::default());
        }
        Ok(())
    }

    fn stop(&mut self, a: &mut Active<Countdown>) {
        let mut stats = Stats::default();
        stats.add_counter("emitted", a.program.emitted as u64);
        a.outbox.finish(FinishReason::StopString, stats);
    }
}

/// A sink backed by a std channel; `closed` simulates the client leaving.
struct TestSink {
    tx: mpsc::SyncSender<Event>,
    closed: Arc<AtomicBool>,
}

impl EventSink for TestSink {
    fn try_send(&mut self, event: Event) -> Result<(), (SinkError, Event)> {
        if self.closed.load(Ordering::Acquire) {
            return Err((SinkError::Closed, event));
        }
        self.tx.try_send(event).map_err(|e| match e {
            mpsc::TrySendError::Full(ev) => (SinkError::Full, ev),
            mpsc::TrySendError::Disconnected(ev) => (SinkError::Closed, ev),
        })
    }
    fn is_closed(&self) -> bool {
        self.closed.load(Ordering::Acquire)
    }
}

/// A [`TestSink`] whose transport saw a stop string once `stop` is set.
struct StoppingSink {
    inner: TestSink,
    stop: Arc<AtomicBool>,
}

impl EventSink for StoppingSink {
    fn try_send(&mut self, event: Event) -> Result<(), (SinkError, Event)> {
        self.inner.try_send(event)
    }
    fn is_closed(&self) -> bool {
        self.inner.is_closed()
    }
    fn stop_requested(&self) -> bool {
        self.stop.load(Ordering::Acquire)
    }
}

fn sink(bound: usize) -> (Box<dyn EventSink>, mpsc::Receiver<Event>, Arc<AtomicBool>) {
    let (tx, rx) = mpsc::sync_channel(bound);
    let closed = Arc::new(AtomicBool::new(false));
    (
        Box::new(TestSink {
            tx,
            closed: closed.clone(),
        }),
        rx,
        closed,
    )
}

fn countdown(len: usize, slots: usize) -> Prepared<Countdown> {
    Prepared {
        program: Countdown {
            len,
            emitted: 0,
            fail_at: None,
        },
        slots,
        max_slots: slots,
        floor: 0,
        prompt_tokens: 1,
        carried: None,
    }
}

fn waiting(id: u64, prepared: Prepared<Countdown>, sink: Box<dyn EventSink>) -> Waiting<Countdown> {
    Waiting {
        id: RequestId(id),
        prepared,
        sink,
        deadline: None,
        submitted_at: Instant::now(),
        span: tracing::Span::none(),
    }
}

fn submission(
    prepared: Prepared<Countdown>,
    sink: Box<dyn EventSink>,
    deadline: Option<Instant>,
) -> Submission<Countdown> {
    Submission {
        prepared,
        sink,
        deadline,
        span: tracing::Span::none(),
    }
}

#[derive(Debug, Clone)]
struct Req {
    slots: usize,
    len: usize,
    fail_at: Option<usize>,
    cancel_at_tick: Option<u64>,
    deadline_ticks: Option<u32>,
    arrive_at: u64,
}

fn req() -> impl Strategy<Value = Req> {
    (
        1usize..6,
        1usize..8,
        prop::option::weighted(0.2, 0usize..8),
        prop::option::weighted(0.2, 0u64..10),
        prop::option::weighted(0.1, 0u32..6),
        0u64..12,
    )
        .prop_map(
            |(slots, len, fail_at, cancel_at_tick, deadline_ticks, arrive_at)| Req {
                slots,
                len,
                fail_at,
                cancel_at_tick,
                deadline_ticks,
                arrive_at,
            },
        )
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(128))]

    /// However requests end, every slot comes back and no slot is shared.
    #[test]
    fn all_slots_return_whatever_happens(
        total in 1usize..16,
        qcap in 1usize..8,
        reqs in proptest::collection::vec(req(), 0..24),
        whole_fail in prop::option::weighted(0.2, 1u64..10),
    ) {
        let mut sched = Scheduler::<Countdown>::new(total, qcap, 8);
        let mut fam = FakeFamily { fail_whole_tick_at: whole_fail, ..Default::default() };
        let t0 = Instant::now();
        let mut handles = Vec::new();
        let mut tick = 0u64;
        let mut rejected = 0usize;
        while tick < 200 {
            let now = t0 + Duration::from_millis(tick * 10);
            for (i, r) in reqs.iter().enumerate() {
                if r.arrive_at == tick {
                    let (s, rx, closed) = sink(64);
                    let w = Waiting {
                        id: RequestId(i as u64),
                        prepared: Prepared { program: Countdown { len: r.len, emitted: 0, fail_at: r.fail_at }, slots: r.slots, max_slots: r.slots, floor: 0, prompt_tokens: 1, carried: None },
                        sink: s,
                        deadline: r.deadline_ticks.map(|d| now + Duration::from_millis(u64::from(d) * 10)),
                        submitted_at: now,
                        span: tracing::Span::none(),
                    };
                    match sched.enqueue(w) {
                        Ok(()) => handles.push((r.clone(), rx, closed)),
                        Err((_, e)) => { rejected += 1; let ok = matches!(e, EngineError::QueueFull { .. } | EngineError::TooLarge { .. }); prop_assert!(ok, "unexpected {:?}", e); }
                    }
                }
            }
            for (r, _, closed) in &handles {
                if r.cancel_at_tick == Some(tick) { closed.store(true, Ordering::Release); }
            }
            sched.tick(&mut fam, now);
            prop_assert!(sched.pool().used() <= total);
            tick += 1;
            if tick > 12 && sched.is_idle() { break; }
        }
        prop_assert!(sched.is_idle(), "requests still running after 200 ticks");
        prop_assert_eq!(sched.pool().free(), total);
        // Every request that was not cancelled got exactly one final event.
        for (r, rx, closed) in handles {
            let events: Vec<Event> = rx.try_iter().collect();
            let finals = events.iter().filter(|e| matches!(e, Event::Finished { .. } | Event::Failed(_))).count();
            if !closed.load(Ordering::Acquire) {
                prop_assert_eq!(finals, 1, "request {:?} got {} final events: {:?}", r, finals, events);
            } else {
                prop_assert!(finals <= 1);
            }
        }
        let _ = rejected;
    }
}

#[test]
fn a_full_queue_is_an_error_not_growth() {
    let mut sched = Scheduler::<Countdown>::new(1, 1, 1);
    let mk = |i| waiting(i, countdown(1, 1), sink(4).0);
    // The first takes the free place (it starts at the next tick, never waiting), the second
    // the queue's one place; the third finds the queue full.
    assert!(sched.enqueue(mk(1)).is_ok());
    assert!(sched.enqueue(mk(2)).is_ok());
    let err = sched.enqueue(mk(3)).err().map(|(_, e)| e);
    assert_eq!(err, Some(EngineError::QueueFull { capacity: 1 }));
}

/// A caller that sends its next request as soon as the last one's final event arrives finds
/// the place that request left, before the engine publishes its load after the step.
#[test]
fn a_place_is_free_before_the_final_event_is_sent() {
    let mut sched = Scheduler::<Countdown>::new(1, 1, 1);
    let mut fam = FakeFamily::default();
    let mk = |i, len| waiting(i, countdown(len, 1), sink(64).0);
    assert!(sched.enqueue(mk(1, 1)).is_ok());
    assert!(sched.enqueue(mk(2, 1)).is_ok());
    assert!(
        sched.enqueue(mk(3, 1)).is_err(),
        "full: one running, one waiting"
    );
    // One step: request 1 runs its only token, ends, and its final event goes out; nothing
    // publishes the engine's load here (the engine thread does that after the step).
    sched.tick(&mut fam, Instant::now());
    assert!(
        sched.enqueue(mk(3, 1)).is_ok(),
        "the place request 1 left takes the next request at once"
    );
    let err = sched.enqueue(mk(4, 1)).err().map(|(_, e)| e);
    assert_eq!(err, Some(EngineError::QueueFull { capacity: 1 }));
}

#[test]
fn a_full_queue_first_drops_waiting_requests_whose_caller_left_or_whose_deadline_passed() {
    // One slot, held by a long request: everything else waits.
    let mut sched = Scheduler::<Countdown>::new(1, 2, 1);
    let mut fam = FakeFamily::default();
    assert!(sched
        .enqueue(waiting(1, countdown(1000, 1), sink(4).0))
        .is_ok());
    sched.tick(&mut fam, Instant::now());
    let (gone, _gone_rx, gone_closed) = sink(4);
    let (late, late_rx, _late_closed) = sink(4);
    assert!(sched.enqueue(waiting(2, countdown(1, 1), gone)).is_ok());
    let mut expiring = waiting(3, countdown(1, 1), late);
    expiring.deadline = Some(Instant::now());
    assert!(sched.enqueue(expiring).is_ok());
    assert_eq!(sched.queued(), 2);
    // The queue is full, but its caller left request 2 and request 3's deadline passed.
    gone_closed.store(true, Ordering::Release);
    assert!(sched
        .enqueue(waiting(4, countdown(1, 1), sink(4).0))
        .is_ok());
    assert_eq!(sched.queued(), 1);
    assert!(matches!(
        late_rx.try_recv(),
        Ok(Event::Failed(EngineError::DeadlineExceeded {
            generated: 0
        }))
    ));
    // Live waiting requests still fill the queue.
    assert!(sched
        .enqueue(waiting(5, countdown(1, 1), sink(4).0))
        .is_ok());
    let err = sched.enqueue(waiting(6, countdown(1, 1), sink(4).0)).err();
    assert!(matches!(
        err,
        Some((_, EngineError::QueueFull { capacity: 2 }))
    ));
}

#[test]
fn a_slow_reader_pauses_only_itself() {
    let mut sched = Scheduler::<Countdown>::new(4, 4, 4);
    let mut fam = FakeFamily::default();
    let (slow, slow_rx, _c1) = sink(1);
    let (fast, fast_rx, _c2) = sink(64);
    for (i, s) in [(1, slow), (2, fast)] {
        let w = waiting(i, countdown(5, 1), s);
        assert!(sched.enqueue(w).is_ok());
    }
    for _ in 0..8 {
        sched.tick(&mut fam, Instant::now());
    }
    // The fast request finished; the slow one is paused with one event buffered.
    let fast_events: Vec<_> = fast_rx.try_iter().collect();
    assert!(matches!(fast_events.last(), Some(Event::Finished { .. })));
    assert_eq!(sched.running(), 1);
    // Reading everything lets it run to completion.
    let mut slow_events = Vec::new();
    for _ in 0..20 {
        slow_events.extend(slow_rx.try_iter());
        sched.tick(&mut fam, Instant::now());
    }
    slow_events.extend(slow_rx.try_iter());
    let tokens: Vec<u32> = slow_events
        .iter()
        .filter_map(|e| {
            if let Event::Tokens(t) = e {
                Some(t[0])
            } else {
                None
            }
        })
        .collect();
    assert_eq!(tokens, vec![0, 1, 2, 3, 4]);
    assert_eq!(sched.pool().free(), 4);
}

#[test]
fn a_stop_from_the_transport_finishes_the_request_with_its_stats_and_frees_its_slots() {
    let mut sched = Scheduler::<Countdown>::new(4, 4, 4);
    let mut fam = FakeFamily::default();
    let (tx, rx) = mpsc::sync_channel(64);
    let stop = Arc::new(AtomicBool::new(false));
    let sink = StoppingSink {
        inner: TestSink {
            tx,
            closed: Arc::new(AtomicBool::new(false)),
        },
        stop: stop.clone(),
    };
    assert!(sched
        .enqueue(waiting(1, countdown(100, 2), Box::new(sink)))
        .is_ok());
    for _ in 0..3 {
        sched.tick(&mut fam, Instant::now());
    }
    stop.store(true, Ordering::Release);
    let report = sched.tick(&mut fam, Instant::now());
    // Finished, not cancelled; not ticked again; its slots are back.
    assert_eq!(
        (report.finished, report.cancelled, report.ticked),
        (1, 0, 0)
    );
    assert_eq!(sched.running(), 0);
    assert_eq!(sched.pool().free(), 4);
    let events: Vec<Event> = rx.try_iter().collect();
    assert_eq!(events.len(), 4, "three tokens, then the end");
    let Some(Event::Finished { reason, stats }) = events.last() else {
        panic!("no Finished event: {events:?}");
    };
    assert_eq!(*reason, FinishReason::StopString);
    // The family's own figures and the engine's.
    assert_eq!(stats.counters.get("emitted"), Some(&3));
    assert_eq!((stats.generated_tokens, stats.ticks), (3, 3));
}

#[test]
fn engine_thread_streams_and_frees_slots_of_a_cancelled_request() {
    let cfg = EngineConfig {
        prompt_sharing: true,
        prefix_cache_entries: 0,
        total_slots: 8,
        queue_capacity: 4,
        max_active: 8,
        watermark_slots: 0,
        max_batch_rows: None,
        write_timeout: None,
    };
    let handle = Engine::start(cfg, || {
        Ok::<_, std::convert::Infallible>(FakeFamily::default())
    })
    .expect("engine starts");
    let (s, rx, _closed) = sink(64);
    let prepared = countdown(3, 2);
    handle.submit(submission(prepared, s, None)).unwrap();
    let mut toks = Vec::new();
    loop {
        match rx.recv_timeout(Duration::from_secs(10)).expect("event") {
            Event::Tokens(t) => toks.extend(t),
            Event::Canvas(_) | Event::Logprobs(_) | Event::PromptLogprobs(_) | Event::Parked => {}
            Event::Finished { reason, stats } => {
                assert_eq!(reason, FinishReason::Length);
                assert_eq!(stats.generated_tokens, 3);
                break;
            }
            Event::Failed(e) => panic!("{e}"),
        }
    }
    assert_eq!(toks, vec![0, 1, 2]);

    // A long request whose client goes away: its slots come back.
    let (s, rx, closed) = sink(1);
    let prepared = countdown(usize::MAX, 5);
    handle.submit(submission(prepared, s, None)).unwrap();
    let _ = rx
        .recv_timeout(Duration::from_secs(10))
        .expect("first token");
    closed.store(true, Ordering::Release);
    drop(rx);
    let t = Instant::now();
    while handle.load().free_slots != 8 {
        assert!(
            t.elapsed() < Duration::from_secs(10),
            "slots not freed: {:?}",
            handle.load()
        );
        std::thread::sleep(Duration::from_millis(1));
    }
    // Too large for the pool: refused at once.
    let (s, _rx, _c) = sink(1);
    let prepared = countdown(1, 9);
    let err = handle.submit(submission(prepared, s, None)).unwrap_err();
    assert_eq!(
        err,
        EngineError::TooLarge {
            needed: 9,
            total: 8
        }
    );
    handle.shutdown();
}

#[test]
fn an_expired_deadline_fails_the_request_and_frees_its_slots() {
    let cfg = EngineConfig {
        prompt_sharing: true,
        prefix_cache_entries: 0,
        total_slots: 4,
        queue_capacity: 4,
        max_active: 4,
        watermark_slots: 0,
        max_batch_rows: None,
        write_timeout: None,
    };
    let handle = Engine::start(cfg, || {
        Ok::<_, std::convert::Infallible>(FakeFamily::default())
    })
    .expect("engine starts");
    let (s, rx, _closed) = sink(1_000_000);
    let prepared = countdown(usize::MAX, 3);
    let deadline = Some(Instant::now() + Duration::from_millis(50));
    handle.submit(submission(prepared, s, deadline)).unwrap();
    let failed = loop {
        match rx.recv_timeout(Duration::from_secs(10)).expect("event") {
            Event::Failed(e) => break e,
            Event::Tokens(_)
            | Event::Canvas(_)
            | Event::Logprobs(_)
            | Event::PromptLogprobs(_)
            | Event::Parked => {}
            Event::Finished { .. } => panic!("cannot finish"),
        }
    };
    assert!(matches!(failed, EngineError::DeadlineExceeded { generated } if generated > 0));
    let t = Instant::now();
    while handle.load().free_slots != 4 {
        assert!(t.elapsed() < Duration::from_secs(10));
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// `load()` never reports an idle engine while a submitted request is still
/// waiting or running (the router and drain logic rely on it).
#[test]
fn load_never_hides_a_submitted_request() {
    let cfg = EngineConfig {
        prompt_sharing: true,
        prefix_cache_entries: 0,
        total_slots: 4,
        queue_capacity: 64,
        max_active: 1,
        watermark_slots: 0,
        max_batch_rows: None,
        write_timeout: None,
    };
    let handle = Engine::start(cfg, || {
        Ok::<_, std::convert::Infallible>(FakeFamily::default())
    })
    .expect("engine starts");
    for round in 0..200u32 {
        let (s, rx, _closed) = sink(64);
        let len = 1 + (round as usize % 3);
        handle
            .submit(submission(countdown(len, 1 + round as usize % 4), s, None))
            .unwrap();
        // The final event is sent before the slots return, so an idle load
        // means the request's `Finished` is already in the channel.
        loop {
            let l = handle.load();
            if l.queued == 0 && l.active == 0 && l.free_slots == l.total_slots {
                let events: Vec<Event> = rx.try_iter().collect();
                assert!(
                    events.iter().any(|e| matches!(e, Event::Finished { .. })),
                    "round {round}: load {l:?} idle before the request finished"
                );
                break;
            }
        }
    }
    handle.shutdown();
}

/// A family whose ticks wait for the test to let them go: an engine busy with a long tick.
struct GatedFamily {
    entered: mpsc::SyncSender<()>,
    go: mpsc::Receiver<()>,
}

impl Family for GatedFamily {
    type Program = Countdown;
    type Plan = ();
    type Output = ();

    fn demand(&self, _a: &Active<Countdown>) -> Demand {
        Demand::Whole(1)
    }

    fn plan(
        &mut self,
        _a: &mut Active<Countdown>,
        _rows: usize,
    ) -> Result<Option<()>, FamilyError> {
        Ok(Some(()))
    }

    fn run(&mut self, work: &mut [Planned<'_, Countdown, ()>]) -> Vec<Group<()>> {
        let _ = self.entered.try_send(());
        let _ = self.go.recv();
        vec![Group::all(work.len(), Ok(vec![(); work.len()]))]
    }

    fn commit(
        &mut self,
        a: &mut Active<Countdown>,
        _plan: (),
        _out: (),
    ) -> Result<(), FamilyError> {
        a.outbox.finish(FinishReason::Length, Stats::default());
        Ok(())
    }
}

#[test]
fn callers_that_left_do_not_hold_queue_places_while_the_engine_is_busy() {
    let cfg = EngineConfig {
        prompt_sharing: true,
        prefix_cache_entries: 0,
        total_slots: 1,
        queue_capacity: 2,
        max_active: 1,
        watermark_slots: 0,
        max_batch_rows: None,
        write_timeout: None,
    };
    let (entered_tx, entered) = mpsc::sync_channel(8);
    let (go, go_rx) = mpsc::sync_channel(8);
    let handle = Engine::start(cfg, move || {
        Ok::<_, std::convert::Infallible>(GatedFamily {
            entered: entered_tx,
            go: go_rx,
        })
    })
    .expect("engine starts");
    let (s, _rx, _c) = sink(8);
    handle.submit(submission(countdown(1, 1), s, None)).unwrap();
    entered.recv().unwrap(); // the engine is inside a tick and will not reap for now
    let mut gone = Vec::new();
    for _ in 0..2 {
        let (s, _rx, closed) = sink(8);
        handle.submit(submission(countdown(1, 1), s, None)).unwrap();
        gone.push(closed);
    }
    let (s, _rx, _c) = sink(8);
    let refused = handle.submit(submission(countdown(1, 1), s, None));
    assert_eq!(refused.err(), Some(EngineError::QueueFull { capacity: 2 }));
    // Both waiting callers leave: their places are free at once, tick or not.
    for c in &gone {
        c.store(true, Ordering::Release);
    }
    let (s, rx, _c) = sink(8);
    handle
        .submit(submission(countdown(1, 1), s, None))
        .expect("the places of callers that left are free");
    assert_eq!(handle.load().queued, 1);
    for _ in 0..4 {
        let _ = go.send(());
    }
    let done = rx
        .recv_timeout(Duration::from_secs(10))
        .expect("the new request runs");
    assert!(matches!(done, Event::Finished { .. }), "{done:?}");
    handle.shutdown();
}
