//! The scheduler: the engine's state as a plain struct, driven one tick at a
//! time, so its invariants are tested directly (no thread, no model).
//!
//! One invariant drives it: every slot is held by at most one running
//! request, except prompt pages the family shares between requests with the
//! same prompt ([`Family::adopt_prompt`]; the pool counts their holders), and a
//! request that leaves for any reason (finished, failed, cancelled by its
//! client, expired) gives all its slots back in the same [`Scheduler::tick`]
//! that notices it (a shared one is free once its last holder gave it back). Admission is FIFO from a bounded queue
//! and happens when the head's first step fits, with a watermark of slots kept
//! free for the running requests to grow into.
//!
//! Slots are granted as work needs them: before each tick, every program that
//! will run gets what [`Family::slots_needed`] says its next step takes, oldest
//! request first. When the pool is short, the most recently admitted running
//! request is preempted ([`Family::preempt`]: its state moves to host memory
//! and its slots return to the pool); preempted requests resume, oldest first,
//! ahead of every new arrival, so nobody starves.
//!
//! A finished request whose prompt state can be shared may instead stay in the
//! prefix cache ([`crate::prefix_cache`]), holding its slots, for later requests
//! with its prompt to adopt; the cache gives slots back, least recently used
//! first, before any admission, resumption or growth would be refused or would
//! preempt a running request, and the slots only it holds count as free.

use crate::error::{EngineError, FamilyError};
use crate::event::Event;
use crate::family::{Adopted, Family};
use crate::ids::{RequestId, SlotId};
use crate::metrics::EngineMetrics;
use crate::prefix_cache::{Cached, PrefixCache};
use crate::queue::AdmissionQueue;
use crate::request::{Active, Carried, Exported, Prepared};
use crate::sink::{EventSink, SinkError};
use crate::slots::SlotPool;
use crate::tick::run_tick;
use std::collections::VecDeque;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// A request waiting for admission.
pub struct Waiting<P> {
    pub id: RequestId,
    pub prepared: Prepared<P>,
    pub sink: Box<dyn EventSink>,
    pub deadline: Option<Instant>,
    pub submitted_at: Instant,
    pub span: tracing::Span,
}

struct Running<P> {
    active: Active<P>,
    sink: Box<dyn EventSink>,
    deadline: Option<Instant>,
    queue_time: Duration,
    prompt_tokens: u32,
    generated: usize,
    /// Events the sink had no room for; the program pauses until they drain.
    backlog: VecDeque<Event>,
    /// Since when the backlog has not drained (the client is not reading): a paused request is
    /// the first to be preempted when the pool is short, and is cancelled after the write
    /// timeout.
    paused_since: Option<Instant>,
    /// Set once the program ended: `Some(true)` finished, `Some(false)` failed.
    outcome: Option<bool>,
    span: tracing::Span,
    /// Exported and waiting for the move to be confirmed or called off: holds no slots, does
    /// not tick, still delivers what it had produced.
    parked: bool,
    /// What engines counted before this request moved here.
    prior: Carried,
}

/// The admission queue, shared by the engine thread and every handle: a submission is pushed
/// under the lock by the caller's thread, the engine pops. When the queue is full, waiting
/// requests whose caller has gone or whose deadline has passed are dropped before the new one
/// is refused, so a place is never held by nobody (the engine may be in the middle of a long
/// tick and reap them only later).
pub struct SharedQueue<P> {
    inner: Mutex<QueueState<P>>,
    total_slots: usize,
}

struct QueueState<P> {
    queue: AdmissionQueue<Waiting<P>>,
    /// Requests the engine took from the queue since it last published its load: not waiting
    /// any more, not yet counted as running by readers of the load.
    taken: usize,
    /// Places free for running requests when the engine last published (`max_active` less
    /// those running, at most the free slots): requests queued into them start at the next
    /// tick, so they are not counted as waiting against the queue's capacity.
    free_places: usize,
}

impl<P> QueueState<P> {
    /// Requests the queue holds before it is full: its capacity, plus the free places the
    /// engine has not taken yet.
    fn limit(&self) -> usize {
        self.queue.capacity() + self.free_places.saturating_sub(self.taken)
    }
}

impl<P> SharedQueue<P> {
    pub fn new(capacity: usize, total_slots: usize) -> Self {
        Self {
            inner: Mutex::new(QueueState {
                queue: AdmissionQueue::new(capacity),
                taken: 0,
                free_places: 0,
            }),
            total_slots,
        }
    }

    fn state(&self) -> MutexGuard<'_, QueueState<P>> {
        // A panic while holding it leaves a consistent queue (every operation is one call).
        self.inner
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn lock(&self) -> QueueGuard<'_, P> {
        QueueGuard(self.state())
    }

    /// Requests waiting.
    pub fn len(&self) -> usize {
        self.state().queue.len()
    }

    /// `(waiting, taken by the engine since it last published its load)`.
    pub(crate) fn counts(&self) -> (usize, usize) {
        let s = self.state();
        (s.queue.len(), s.taken)
    }

    /// A running request ended (its final event is about to go out): one more place until the
    /// engine next publishes its load.
    pub(crate) fn place_freed(&self) {
        let mut s = self.state();
        s.free_places = s.free_places.saturating_add(1);
    }

    /// The engine published a load that counts every request it took, with `free_places`
    /// places for more.
    pub(crate) fn settled(&self, free_places: usize) {
        let mut s = self.state();
        s.taken = 0;
        s.free_places = free_places;
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// [`AdmissionQueue::pop_first_unheld`] under the lock.
    fn pop_first_unheld(
        &self,
        held: impl Fn(&Waiting<P>) -> bool,
        fits: impl FnOnce(&Waiting<P>) -> bool,
    ) -> Result<Waiting<P>, bool> {
        let mut s = self.state();
        let w = s.queue.pop_first_unheld(held, fits);
        if w.is_ok() {
            s.taken += 1;
        }
        w
    }

    pub fn capacity(&self) -> usize {
        self.lock().capacity()
    }

    /// Queues `w` at `now`; a request that can never fit, or a full queue once the gone and
    /// expired waiting requests are dropped, hands it back with the error to send.
    pub fn push(&self, w: Waiting<P>, now: Instant) -> Result<(), (Waiting<P>, EngineError)> {
        let most = w.prepared.slots.max(w.prepared.max_slots);
        if most > self.total_slots {
            let err = EngineError::TooLarge {
                needed: most,
                total: self.total_slots,
            };
            return Err((w, err));
        }
        let mut s = self.state();
        Self::reap_if_full(&mut s, now);
        let (limit, capacity) = (s.limit(), s.queue.capacity());
        s.queue
            .push_within(w, limit)
            .map_err(|w| (w, EngineError::QueueFull { capacity }))
    }

    /// Whether a push at `now` would find a place (after dropping gone and expired waiting
    /// requests, as a push does): a cheap test before the work of preparing a request, so a
    /// flood beyond the queue is refused before it costs tokenizing.
    pub fn has_room(&self, now: Instant) -> bool {
        let mut s = self.state();
        Self::reap_if_full(&mut s, now);
        s.queue.len() < s.limit()
    }

    fn reap_if_full(s: &mut QueueState<P>, now: Instant) {
        if s.queue.len() < s.limit() {
            return;
        }
        for mut gone in s
            .queue
            .drain_where(|w| w.sink.is_closed() || w.deadline.is_some_and(|d| d <= now))
        {
            if !gone.sink.is_closed() {
                let _ = gone
                    .sink
                    .try_send(Event::Failed(EngineError::DeadlineExceeded {
                        generated: 0,
                    }));
            }
        }
    }
}

/// The queue under its lock.
struct QueueGuard<'a, P>(MutexGuard<'a, QueueState<P>>);

impl<P> std::ops::Deref for QueueGuard<'_, P> {
    type Target = AdmissionQueue<Waiting<P>>;
    fn deref(&self) -> &Self::Target {
        &self.0.queue
    }
}

impl<P> std::ops::DerefMut for QueueGuard<'_, P> {
    fn deref_mut(&mut self) -> &mut Self::Target {
        &mut self.0.queue
    }
}

/// Whose prompt pages an admitted request reads.
#[derive(Clone, Copy)]
enum Donor {
    /// The running request at this index.
    Running(usize),
    /// The prefix cache's most recently used entry.
    Cached,
}

/// Why a request leaves before its end.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Leave {
    /// Its client went away.
    Closed,
    /// Its deadline passed.
    Expired,
    /// Its client left its events unread past the write timeout.
    Stalled,
}

/// Counts of what one [`Scheduler::tick`] did.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct TickReport {
    pub admitted: usize,
    pub ticked: usize,
    pub finished: usize,
    pub cancelled: usize,
    pub expired: usize,
    pub failed: usize,
    pub preempted: usize,
    pub resumed: usize,
    /// Requests cancelled because their client left their events unread past the write timeout.
    pub stalled: usize,
}

/// Finished requests the prefix cache keeps by default (`--prefix-cache-entries`).
pub const DEFAULT_PREFIX_CACHE_ENTRIES: usize = 64;

pub struct Scheduler<P> {
    queue: Arc<SharedQueue<P>>,
    pool: SlotPool,
    running: Vec<Running<P>>,
    /// Preempted requests, holding no slots, in admission order: they resume before any new
    /// arrival is admitted.
    preempted: Vec<Running<P>>,
    max_active: usize,
    /// Slots admission leaves free for running requests to grow into.
    watermark: usize,
    next_seq: u64,
    preemptions: u64,
    /// Requests that wait this tick for slots held by requests still delivering.
    deferred: Vec<RequestId>,
    /// Rows one tick computes at most (`--max-batch-rows`).
    max_batch_rows: Option<usize>,
    /// Whether requests with the same prompt share its pages.
    prompt_sharing: bool,
    /// Finished requests kept for their prompt pages (`--prefix-cache-entries`).
    cache: PrefixCache<P>,
    /// How long a request's client may leave its events unread before the request is
    /// cancelled (`--write-timeout-s`); `None`: forever.
    write_timeout: Option<Duration>,
    ticks: u64,
    metrics: EngineMetrics,
}

impl<P: Send + 'static> Scheduler<P> {
    pub fn new(total_slots: usize, queue_capacity: usize, max_active: usize) -> Self {
        Self {
            queue: Arc::new({
                let q = SharedQueue::new(queue_capacity, total_slots);
                // Every place is free before the first tick.
                q.settled(max_active.max(1).min(total_slots));
                q
            }),
            pool: SlotPool::new(total_slots),
            running: Vec::new(),
            preempted: Vec::new(),
            max_active: max_active.max(1),
            watermark: 0,
            next_seq: 0,
            preemptions: 0,
            deferred: Vec::new(),
            max_batch_rows: None,
            prompt_sharing: true,
            cache: PrefixCache::new(DEFAULT_PREFIX_CACHE_ENTRIES),
            write_timeout: None,
            ticks: 0,
            metrics: EngineMetrics::none(),
        }
    }

    /// Keeps `slots` free at admission for the running requests to grow into (a new request is
    /// admitted alone whatever the watermark, so one always runs).
    pub fn with_watermark(mut self, slots: usize) -> Self {
        self.watermark = slots;
        self
    }

    /// Caps the rows of a tick: prefills that may run in part share what the whole steps leave.
    /// Whether requests with the same prompt share its pages ([`Family::adopt_prompt`]); on by
    /// default.
    pub fn with_prompt_sharing(mut self, on: bool) -> Self {
        self.prompt_sharing = on;
        self
    }

    /// Keeps up to `entries` finished requests for their prompt pages (the prefix cache;
    /// 0: none). Only with prompt sharing on.
    pub fn with_prefix_cache(mut self, entries: usize) -> Self {
        self.cache.set_capacity(entries);
        self
    }

    pub fn with_max_batch_rows(mut self, rows: Option<usize>) -> Self {
        self.max_batch_rows = rows;
        self
    }

    /// Cancels a request whose client has left its events unread for `timeout`.
    pub fn with_write_timeout(mut self, timeout: Option<Duration>) -> Self {
        self.write_timeout = timeout;
        self
    }

    /// Names the model in this scheduler's metrics.
    pub fn with_label(mut self, label: &str) -> Self {
        self.metrics = EngineMetrics::new(label);
        self
    }

    /// Sets the slot and queue gauges. Slots only the prefix cache holds count as free (it
    /// gives them back when they are needed), and have their own gauge.
    pub fn publish_gauges(&self) {
        let cached = self.cached_slots();
        let used = self.pool.used() - cached;
        self.metrics.slots_total.set(self.pool.total() as f64);
        self.metrics.slots_used.set(used as f64);
        self.metrics.slots_cached.set(cached as f64);
        self.metrics
            .cache_usage
            .set(used as f64 / self.pool.total().max(1) as f64);
        self.metrics.queue_depth.set(self.queue.len() as f64);
        self.metrics.active.set(self.running() as f64);
        self.metrics.preempted.set(self.preempted.len() as f64);
        self.metrics.slots_shared.set(self.pool.shared() as f64);
    }

    /// Publishes the bytes the family's pools have allocated ([`crate::Family::pool_bytes`]).
    pub fn publish_pool_bytes(&self, bytes: u64) {
        self.metrics.pool_bytes.set(bytes as f64);
    }

    pub fn pool(&self) -> &SlotPool {
        &self.pool
    }

    /// Slots a request can have now: the free ones and those only the prefix cache holds.
    pub fn available(&self) -> usize {
        self.pool.free() + self.cached_slots()
    }

    /// Slots only the prefix cache holds (free once it lets go of its entries).
    pub fn cached_slots(&self) -> usize {
        self.pool.kept_only()
    }

    /// Finished requests the prefix cache keeps now.
    pub fn cached_prompts(&self) -> usize {
        self.cache.len()
    }

    pub fn queued(&self) -> usize {
        self.queue.len()
    }

    /// The admission queue, for handles that submit from other threads.
    pub fn shared_queue(&self) -> Arc<SharedQueue<P>> {
        self.queue.clone()
    }

    /// Requests run together at most.
    pub fn max_active(&self) -> usize {
        self.max_active
    }

    /// Requests admitted and not finished: running, or preempted and waiting to resume.
    pub fn running(&self) -> usize {
        self.running.len() + self.preempted.len()
    }

    /// Preempted requests waiting to resume.
    pub fn preempted(&self) -> usize {
        self.preempted.len()
    }

    /// Preemptions since the start.
    pub fn preemptions(&self) -> u64 {
        self.preemptions
    }

    pub fn is_idle(&self) -> bool {
        self.queue.is_empty() && self.running.is_empty() && self.preempted.is_empty()
    }

    pub fn ticks(&self) -> u64 {
        self.ticks
    }

    /// Queues a request; a full queue hands it back with the error to send.
    pub fn enqueue(&mut self, w: Waiting<P>) -> Result<(), (Waiting<P>, EngineError)> {
        self.queue.push(w, Instant::now())
    }

    /// One engine iteration, a *tick*: reap, admit, grow, compute (plan → run → commit, then
    /// reclaim), deliver.
    pub fn tick<F: Family<Program = P>>(&mut self, family: &mut F, now: Instant) -> TickReport {
        let mut report = TickReport::default();
        self.reap(family, now, &mut report);
        self.admit(family, now, &mut report);
        self.grow(family, &mut report);
        self.compute(family, &mut report);
        self.deliver(family, &mut report);
        report
    }

    fn reap<F: Family<Program = P>>(
        &mut self,
        family: &mut F,
        now: Instant,
        report: &mut TickReport,
    ) {
        // Waiting requests whose client left or whose deadline passed.
        let gone = self
            .queue
            .lock()
            .drain_where(|w| w.sink.is_closed() || w.deadline.is_some_and(|d| d <= now));
        for mut w in gone {
            if w.sink.is_closed() {
                report.cancelled += 1;
            } else {
                report.expired += 1;
                let _ = w
                    .sink
                    .try_send(Event::Failed(EngineError::DeadlineExceeded {
                        generated: 0,
                    }));
            }
        }
        // Preempted requests: cancelled, expired or stalled ones leave; stopped ones go back to
        // the running ones (holding no slots) to deliver their Finished event.
        let mut i = 0;
        while i < self.preempted.len() {
            let why = leaves(&self.preempted[i], now, self.write_timeout);
            let stopped = why.is_none() && self.preempted[i].sink.stop_requested();
            if why.is_some() || stopped {
                let mut r = self.preempted.remove(i);
                match why {
                    Some(why) => self.leave(family, r, why, report),
                    None => {
                        family.stop(&mut r.active);
                        self.running.push(r);
                    }
                }
            } else {
                i += 1;
            }
        }
        // Running requests: cancelled, expired or stalled ones leave now; stopped ones finish
        // (their Finished event is delivered this tick and they leave as finished requests).
        let mut i = 0;
        while i < self.running.len() {
            let why = leaves(&self.running[i], now, self.write_timeout);
            let r = &mut self.running[i];
            if why.is_none() && !r.active.outbox.done && r.sink.stop_requested() {
                tracing::debug!(parent: &r.span, request = %r.active.id, "stopped by the transport");
                family.stop(&mut r.active);
            }
            if let Some(why) = why {
                let r = self.running.swap_remove(i);
                self.leave(family, r, why, report);
            } else {
                i += 1;
            }
        }
    }

    /// A request whose client went away, whose deadline passed or whose client stopped reading
    /// leaves, with DEADLINE_EXCEEDED for an expired one and the write timeout's error for a
    /// stalled one, and its slots return.
    fn leave<F: Family<Program = P>>(
        &mut self,
        family: &mut F,
        mut r: Running<P>,
        why: Leave,
        report: &mut TickReport,
    ) {
        match why {
            Leave::Closed => {
                report.cancelled += 1;
                tracing::debug!(parent: &r.span, request = %r.active.id, "client went away; freeing slots");
            }
            Leave::Expired => {
                report.expired += 1;
                r.backlog.clear();
                let _ = r
                    .sink
                    .try_send(Event::Failed(EngineError::DeadlineExceeded {
                        generated: r.generated,
                    }));
            }
            Leave::Stalled => {
                report.stalled += 1;
                let secs = self.write_timeout.map_or(0, |t| t.as_secs());
                tracing::info!(parent: &r.span, request = %r.active.id, secs, "client left its response unread; cancelling the request");
                r.backlog.clear();
                r.sink.abandon(EngineError::WriteTimeout { secs });
            }
        }
        self.retire(family, r);
    }

    /// Slots free for a request that needs `need` now (the prefix cache's counted as free),
    /// keeping the watermark unless nothing runs.
    fn fits(&self, need: usize) -> bool {
        need + self.reserve() <= self.available()
    }

    /// Lets go of prefix-cache entries, least recently used first, until `n` slots are free
    /// or the cache is empty.
    fn make_room<F: Family<Program = P>>(&mut self, family: &mut F, n: usize) {
        while self.pool.free() < n {
            let Some(c) = self.cache.pop_oldest() else {
                return;
            };
            self.evict(family, c);
        }
    }

    fn evict<F: Family<Program = P>>(&mut self, family: &mut F, mut c: Cached<P>) {
        tracing::debug!(request = %c.active.id, slots = c.active.slots.len(), "prompt evicted from the prefix cache");
        family.release(&mut c.active);
        self.pool.release_kept(std::mem::take(&mut c.active.slots));
        self.metrics.prefix_cache_evictions.increment(1);
    }

    /// The slots kept free for running requests to grow into: the watermark, unless none of
    /// them can grow (nothing runs, or every one waits for its client to read).
    fn reserve(&self) -> usize {
        let growing = self
            .running
            .iter()
            .any(|r| !r.active.outbox.done && r.backlog.is_empty());
        if growing {
            self.watermark
        } else {
            0
        }
    }

    fn admit<F: Family<Program = P>>(
        &mut self,
        family: &mut F,
        now: Instant,
        report: &mut TickReport,
    ) {
        // Preempted requests first, oldest first; while one waits, no new request starts. A
        // paused one (its client not reading) waits for its backlog to go out instead, and
        // holds up no one.
        // Requests whose clients are not reading give way (they are preempted in turn).
        while let Some(next) = self.preempted.iter().position(|r| r.backlog.is_empty()) {
            if self.running.len() >= self.max_active {
                // The request preempted joins `preempted` (in admission order, so `next` may
                // now point elsewhere): look again.
                if self.preempt_paused(family, report) {
                    continue;
                }
                return;
            }
            let need = family.slots_needed(&self.preempted[next].active);
            if !self.fits(need) {
                if self.preempt_paused(family, report) {
                    continue;
                }
                return;
            }
            let mut r = self.preempted.remove(next);
            self.make_room(family, need);
            let slots = self.pool.alloc(need).expect("checked free slots above");
            r.active.slots.extend(&slots);
            r.active.new_slots.extend(slots);
            match family.resume(&mut r.active) {
                Ok(moved) => {
                    self.metrics.bytes_from_host.increment(moved.bytes);
                    self.metrics
                        .recomputed_rows
                        .increment(moved.recomputed_rows);
                    tracing::debug!(parent: &r.span, request = %r.active.id, bytes = moved.bytes, "resumed");
                }
                Err(e) => r.active.outbox.fail(e),
            }
            report.resumed += 1;
            self.running.push(r);
        }
        if self.preempted.iter().any(|r| r.backlog.is_empty()) {
            return;
        }
        loop {
            // A request whose client is not reading makes no progress: it gives its place and
            // its slots to a waiting one (it resumes once its events have gone out).
            if self.running.len() >= self.max_active
                && (self.queue.is_empty() || !self.preempt_paused(family, report))
            {
                break;
            }
            // A request whose prompt pages a running request is computing waits for them (it
            // reads them instead of computing them again), keeping its place; the requests
            // behind it go ahead.
            let reserve = self.reserve();
            let free = self.available();
            let fam: &F = family;
            let popped = self.queue.pop_first_unheld(
                |w| w.prepared.carried.is_none() && self.waits_for_prompt(fam, &w.prepared.program),
                |w| w.prepared.slots + reserve <= free,
            );
            let w = match popped {
                Ok(w) => w,
                Err(true) if self.preempt_paused(family, report) => continue,
                Err(_) => break,
            };
            if w.prepared.carried.is_some() {
                self.take_in(family, w, now, report);
                // It resumes as a preempted request, ahead of every later arrival.
                return self.admit(family, now, report);
            }
            self.next_seq += 1;
            let Waiting {
                id,
                prepared,
                sink,
                deadline,
                submitted_at,
                span,
            } = w;
            let mut active = Active {
                admitted_at: now,
                seq: self.next_seq,
                floor: prepared.floor,
                ..Active::new(id, prepared.program)
            };
            let shared = self.adopt_prompt(family, &mut active, &span);
            let need = prepared.slots.saturating_sub(shared.len());
            self.make_room(family, need);
            let slots = self.pool.alloc(need).expect("checked free slots above");
            let queue_time = now.saturating_duration_since(submitted_at);
            tracing::debug!(parent: &span, request = %active.id, slots = slots.len(), shared = shared.len(), ?queue_time, "admitted");
            active.slots = shared;
            active.slots.extend(&slots);
            active.new_slots = slots;
            self.running.push(Running {
                active,
                sink,
                deadline,
                queue_time,
                prompt_tokens: u32::try_from(prepared.prompt_tokens).unwrap_or(u32::MAX),
                generated: 0,
                backlog: VecDeque::new(),
                paused_since: None,
                outcome: None,
                span,
                parked: false,
                prior: Carried::default(),
            });
            report.admitted += 1;
        }
    }

    /// A running request that computes the prompt pages `program` would share, and whose
    /// client reads (one paused would hold the waiting one up), unless the prefix cache has
    /// them.
    fn waits_for_prompt<F: Family<Program = P>>(&self, family: &F, program: &P) -> bool {
        let Some(key) = family.share_key(program).filter(|_| self.prompt_sharing) else {
            return false;
        };
        // The prefix cache has them already.
        if self.cache.has(key) {
            return false;
        }
        self.running.iter().any(|r| {
            !r.active.outbox.done
                && !r.parked
                && r.backlog.is_empty()
                && family.share_key(&r.active.program) == Some(key)
                && family.prompt_pending(&r.active)
        })
    }

    /// Admits `taker` onto the prompt pages of a running request with its share key whose
    /// prompt is computed, or else of the prefix cache's entry with that key, if there is one:
    /// the slots it now holds with that request (each counted as held once more), none
    /// otherwise. A family's refusal is logged and the request computes its prompt itself (an
    /// entry that refused leaves the cache).
    fn adopt_prompt<F: Family<Program = P>>(
        &mut self,
        family: &mut F,
        taker: &mut Active<P>,
        span: &tracing::Span,
    ) -> Vec<SlotId> {
        let Some(key) = family
            .share_key(&taker.program)
            .filter(|_| self.prompt_sharing)
        else {
            return Vec::new();
        };
        let donor = self.running.iter().position(|r| {
            !r.active.outbox.done
                && !r.parked
                && family.share_key(&r.active.program) == Some(key)
                && !family.prompt_pending(&r.active)
        });
        let from = match donor {
            Some(j) => Donor::Running(j),
            None if self.cache.touch(key).is_some() => Donor::Cached,
            // No donor with the whole prompt: the one holding the longest common prefix.
            None => match self.longest_prefix(family, taker) {
                Some(from) => from,
                None => return Vec::new(),
            },
        };
        let adopted = match from {
            Donor::Running(j) => family.adopt_prompt(&mut self.running[j].active, taker),
            Donor::Cached => {
                let entry = self.cache.newest_mut().expect("touched above");
                let adopted = family.adopt_prompt(&mut entry.active, taker);
                match &adopted {
                    // An adoption that shared nothing (a taker that had already computed rows of
                    // its own, such as one moved here with its state) is no hit.
                    Ok(a) if a.rows == 0 => {}
                    Ok(a) => {
                        self.metrics.prefix_cache_hits.increment(1);
                        self.metrics
                            .prefix_cache_hit_tokens
                            .increment(a.rows as u64);
                    }
                    Err(_) => {
                        let entry = self.cache.pop_newest().expect("touched above");
                        self.evict(family, entry);
                    }
                }
                adopted
            }
        };
        match adopted {
            Ok(Adopted { slots: shared, .. }) => {
                self.pool.share(&shared);
                self.metrics
                    .prompt_pages_shared
                    .increment(shared.len() as u64);
                shared
            }
            Err(e) => {
                tracing::warn!(parent: span, request = %taker.id, error = %e, "prompt pages not shared");
                Vec::new()
            }
        }
    }

    /// The running request or prefix-cache entry whose pages hold the most rows of `taker`'s
    /// prompt where their prompts only begin alike ([`Family::prefix_rows`]); an entry chosen
    /// becomes the most recently used. `None` when none holds any.
    fn longest_prefix<F: Family<Program = P>>(
        &mut self,
        family: &F,
        taker: &Active<P>,
    ) -> Option<Donor> {
        // (rows, Ok(running index) or Err(cache index)).
        let mut best: Option<(usize, Result<usize, usize>)> = None;
        let mut consider = |rows: usize, at| {
            if rows > best.map_or(0, |b| b.0) {
                best = Some((rows, at));
            }
        };
        for (j, r) in self.running.iter().enumerate() {
            if !r.active.outbox.done && !r.parked && !family.prompt_pending(&r.active) {
                consider(family.prefix_rows(&r.active, taker), Ok(j));
            }
        }
        // The most recently used first, so it wins a tie.
        for (i, c) in self.cache.iter().enumerate().rev() {
            consider(family.prefix_rows(&c.active, taker), Err(i));
        }
        match best?.1 {
            Ok(j) => Some(Donor::Running(j)),
            Err(i) => {
                self.cache.touch_at(i);
                Some(Donor::Cached)
            }
        }
    }

    /// Keeps a request that finished in the prefix cache if its prompt state can be shared
    /// and no entry has its key yet; hands it back otherwise.
    fn cache_prompt<F: Family<Program = P>>(
        &mut self,
        family: &mut F,
        r: Running<P>,
    ) -> Option<Running<P>> {
        if !self.prompt_sharing
            || self.cache.capacity() == 0
            || r.parked
            || r.active.slots.is_empty()
            || family.prompt_pending(&r.active)
        {
            return Some(r);
        }
        let key = match family.share_key(&r.active.program) {
            Some(key) if !self.cache.has(key) => key,
            _ => return Some(r),
        };
        tracing::debug!(parent: &r.span, request = %r.active.id, slots = r.active.slots.len(), "prompt kept in the prefix cache");
        self.pool.keep(&r.active.slots);
        for old in self.cache.insert(Cached {
            active: r.active,
            key,
        }) {
            self.evict(family, old);
        }
        None
    }

    /// Preempts the newest running request whose client is not reading (its events wait in
    /// its backlog); `false` when there is none.
    fn preempt_paused<F: Family<Program = P>>(
        &mut self,
        family: &mut F,
        report: &mut TickReport,
    ) -> bool {
        let paused = (0..self.running.len())
            .filter(|&j| {
                let r = &self.running[j];
                !r.active.outbox.done && !r.parked && !r.backlog.is_empty()
            })
            .max_by_key(|&j| self.running[j].active.seq);
        match paused {
            Some(j) => {
                self.preempt(family, j, report);
                true
            }
            None => false,
        }
    }

    /// Whether the running request at `i` ticks this step.
    fn ready(&self, i: usize) -> bool {
        let r = &self.running[i];
        r.backlog.is_empty()
            && !r.active.outbox.done
            && !r.parked
            && !self.deferred.contains(&r.active.id)
    }

    /// Grants every request that ticks this step the slots its next step needs, oldest first,
    /// preempting the most recently admitted ones while the pool is short.
    fn grow<F: Family<Program = P>>(&mut self, family: &mut F, report: &mut TickReport) {
        self.deferred.clear();
        let mut order: Vec<(u64, RequestId)> = (0..self.running.len())
            .filter(|&i| self.ready(i))
            .map(|i| (self.running[i].active.seq, self.running[i].active.id))
            .collect();
        order.sort_unstable();
        for (_, id) in order {
            // Until granted, or preempted (for an older request, or itself as the newest).
            while let Some(i) = self.running.iter().position(|r| r.active.id == id) {
                let need = family.slots_needed(&self.running[i].active);
                let held = self.running[i].active.slots.len();
                if need <= held {
                    break;
                }
                self.make_room(family, need - held);
                if let Some(slots) = self.pool.alloc(need - held) {
                    let a = &mut self.running[i].active;
                    a.slots.extend(&slots);
                    a.new_slots.extend(slots);
                    break;
                }
                // The request that can give its slots back: the newest whose client is not
                // reading (it makes no progress anyway), else the newest, possibly this one.
                let candidates = (0..self.running.len())
                    .filter(|&j| !self.running[j].active.outbox.done && !self.running[j].parked);
                let victim = candidates
                    .clone()
                    .filter(|&j| !self.running[j].backlog.is_empty())
                    .max_by_key(|&j| self.running[j].active.seq)
                    .or_else(|| candidates.max_by_key(|&j| self.running[j].active.seq))
                    .expect("the growing request is a candidate");
                if victim == i && self.running.len() == 1 + self.done_count() + self.parked_count()
                {
                    let total = self.pool.total();
                    if need > total {
                        self.running[i]
                            .active
                            .outbox
                            .fail(FamilyError::PoolTooSmall { need, total });
                    } else {
                        // The rest of the pool is held by requests whose last events are
                        // still going out (slow readers): it comes back when they drain.
                        self.deferred.push(id);
                    }
                    break;
                }
                self.preempt(family, victim, report);
            }
        }
    }

    /// Running requests whose program has ended (their last events still going out).
    fn done_count(&self) -> usize {
        self.running.iter().filter(|r| r.active.outbox.done).count()
    }

    /// Exported requests waiting for their move to be settled (they hold no slots).
    fn parked_count(&self) -> usize {
        self.running
            .iter()
            .filter(|r| r.parked && !r.active.outbox.done)
            .count()
    }

    /// Preempts the running request at `i`: the family moves its state out, its slots go back
    /// to the pool, and it waits to resume ahead of new arrivals.
    fn preempt<F: Family<Program = P>>(
        &mut self,
        family: &mut F,
        i: usize,
        report: &mut TickReport,
    ) {
        let r = &mut self.running[i];
        match family.preempt(&mut r.active) {
            Ok(moved) => {
                let mut r = self.running.swap_remove(i);
                tracing::debug!(parent: &r.span, request = %r.active.id, bytes = moved.bytes, slots = r.active.slots.len(), "preempted");
                self.pool.release(std::mem::take(&mut r.active.slots));
                r.active.new_slots.clear();
                self.metrics.preemptions.increment(1);
                self.preemptions += 1;
                self.metrics.bytes_to_host.increment(moved.bytes);
                report.preempted += 1;
                let at = self
                    .preempted
                    .partition_point(|p| p.active.seq < r.active.seq);
                self.preempted.insert(at, r);
            }
            Err(e) => {
                tracing::warn!(parent: &r.span, request = %r.active.id, error = %e, "cannot preempt; failing the request");
                r.active.outbox.fail(e);
            }
        }
    }

    /// The compute part of the tick: every ready program through plan → run → commit
    /// ([`run_tick`]), then the slots they no longer need back to the pool.
    fn compute<F: Family<Program = P>>(&mut self, family: &mut F, report: &mut TickReport) {
        let ready: Vec<usize> = (0..self.running.len()).filter(|&i| self.ready(i)).collect();
        if ready.is_empty() {
            return;
        }
        self.ticks += 1;
        let span = tracing::info_span!("tick", tick = self.ticks, requests = ready.len());
        for &i in &ready {
            span.follows_from(self.running[i].span.id());
        }
        let _enter = span.enter();
        let mut batch: Vec<&mut Active<P>> = Vec::with_capacity(ready.len());
        // Collect disjoint &mut borrows of the ready entries.
        let mut rest: &mut [Running<P>] = &mut self.running;
        let mut base = 0;
        for &i in &ready {
            let (_, tail) = rest.split_at_mut(i - base);
            let (head, tail) = tail.split_at_mut(1);
            head[0].active.ticks += 1;
            batch.push(&mut head[0].active);
            rest = tail;
            base = i + 1;
        }
        report.ticked = batch.len();
        let started = Instant::now();
        let outcome = run_tick(family, &mut batch, self.max_batch_rows);
        self.metrics
            .tick_duration
            .record(started.elapsed().as_secs_f64());
        self.metrics.tick_requests.record(batch.len() as f64);
        self.metrics.ticks.increment(1);
        self.metrics.tick_rows.record(outcome.rows as f64);
        // What programs no longer need goes back to the pool now, not at their end.
        for a in batch {
            if a.outbox.done {
                continue;
            }
            let back = family.reclaim(a);
            if back.is_empty() {
                continue;
            }
            let before = a.slots.len();
            a.slots.retain(|s| !back.contains(s));
            assert_eq!(
                a.slots.len() + back.len(),
                before,
                "a family reclaimed slots its request does not hold"
            );
            self.pool.release(back);
        }
    }

    fn deliver<F: Family<Program = P>>(&mut self, family: &mut F, report: &mut TickReport) {
        let now = Instant::now();
        let mut i = 0;
        while i < self.running.len() {
            let r = &mut self.running[i];
            for ev in r.active.outbox.events.drain(..) {
                let ev = match ev {
                    Event::Tokens(ids) => {
                        r.generated += ids.len();
                        Event::Tokens(ids)
                    }
                    Event::Canvas(frame) => Event::Canvas(frame),
                    Event::Logprobs(lp) => Event::Logprobs(lp),
                    Event::PromptLogprobs(lp) => Event::PromptLogprobs(lp),
                    Event::Parked => Event::Parked,
                    Event::Finished { reason, mut stats } => {
                        stats.queue_time = r.queue_time;
                        stats.compute_time = r.prior.compute_time
                            + now.saturating_duration_since(r.active.admitted_at);
                        stats.ticks = r.prior.ticks + r.active.ticks;
                        stats.migrations = r.prior.migrations;
                        stats.prompt_tokens = r.prompt_tokens;
                        stats.generated_tokens = u32::try_from(r.generated).unwrap_or(u32::MAX);
                        r.outcome = Some(true);
                        // The place is free before the caller can hear of it: a caller that
                        // sends its next request on this answer finds the place, not a queue
                        // still counting the request that just ended (published after the step).
                        self.queue.place_freed();
                        Event::Finished { reason, stats }
                    }
                    Event::Failed(e) => {
                        r.outcome = Some(false);
                        self.queue.place_freed();
                        Event::Failed(e)
                    }
                };
                r.backlog.push_back(ev);
            }
            let closed = drain_backlog(r, now);
            let done = r.active.outbox.done && r.backlog.is_empty();
            if closed || done {
                let r = self.running.swap_remove(i);
                let finished = !closed && r.outcome == Some(true);
                match (closed, r.outcome) {
                    (true, _) => report.cancelled += 1,
                    (false, Some(true)) => report.finished += 1,
                    (false, _) => report.failed += 1,
                }
                let r = if finished {
                    self.cache_prompt(family, r)
                } else {
                    Some(r)
                };
                if let Some(r) = r {
                    self.retire(family, r);
                }
            } else {
                i += 1;
            }
        }
        // Preempted requests still deliver what they produced before: a paused one (its client
        // not reading) resumes once its backlog has gone out.
        let mut i = 0;
        while i < self.preempted.len() {
            if drain_backlog(&mut self.preempted[i], now) {
                let r = self.preempted.remove(i);
                report.cancelled += 1;
                self.retire(family, r);
            } else {
                i += 1;
            }
        }
    }

    fn retire<F: Family<Program = P>>(&mut self, family: &mut F, mut r: Running<P>) {
        family.release(&mut r.active);
        self.pool.release(std::mem::take(&mut r.active.slots));
    }

    /// Takes in a request exported by another worker: it waits with the preempted requests
    /// (it holds no slots) and resumes when its state fits; one that can never fit fails.
    fn take_in<F: Family<Program = P>>(
        &mut self,
        family: &mut F,
        w: Waiting<P>,
        now: Instant,
        report: &mut TickReport,
    ) {
        let prior = w.prepared.carried.clone().unwrap_or_default();
        self.next_seq += 1;
        let mut r = Running {
            active: Active {
                admitted_at: now,
                seq: self.next_seq,
                floor: w.prepared.floor,
                ..Active::new(w.id, w.prepared.program)
            },
            sink: w.sink,
            deadline: w.deadline,
            queue_time: prior.queue_time,
            prompt_tokens: u32::try_from(prior.prompt_tokens).unwrap_or(u32::MAX),
            generated: prior.generated,
            backlog: VecDeque::new(),
            paused_since: None,
            outcome: None,
            span: w.span,
            parked: false,
            prior,
        };
        report.admitted += 1;
        let need = family.slots_needed(&r.active);
        if need > self.pool.total() {
            r.active.outbox.fail(FamilyError::PoolTooSmall {
                need,
                total: self.pool.total(),
            });
            self.running.push(r);
            return;
        }
        tracing::debug!(parent: &r.span, request = %r.active.id, need, "taken in from another worker");
        self.preempted.push(r);
    }

    /// Stops request `id` at this step boundary and encodes its state for another worker: its
    /// family preempts it (its slots go back to the pool) and exports the program. The request
    /// stays here, parked, until [`Scheduler::finish_export`] says whether it moved; its events
    /// so far are still delivered, followed by [`Event::Parked`].
    pub fn export<F: Family<Program = P>>(
        &mut self,
        family: &mut F,
        id: RequestId,
        now: Instant,
    ) -> Result<Exported, EngineError> {
        if let Some(i) = self.preempted.iter().position(|r| r.active.id == id) {
            let r = self.preempted.remove(i);
            self.running.push(r);
        } else {
            let Some(i) = self.running.iter().position(|r| r.active.id == id) else {
                return Err(EngineError::NotFound(format!(
                    "no running request {id} on this worker (it finished or never ran here)"
                )));
            };
            let r = &mut self.running[i];
            if r.active.outbox.done {
                return Err(EngineError::CannotMove(format!(
                    "request {id} has already finished"
                )));
            }
            if r.parked {
                return Err(EngineError::CannotMove(format!(
                    "request {id} is already being moved"
                )));
            }
            let moved = family.preempt(&mut r.active).map_err(|e| {
                EngineError::CannotMove(format!("request {id} cannot be stopped here: {e}"))
            })?;
            self.pool.release(std::mem::take(&mut r.active.slots));
            r.active.new_slots.clear();
            self.metrics.bytes_to_host.increment(moved.bytes);
        }
        let i = self.running.len() - 1;
        let i = if self.running[i].active.id == id {
            i
        } else {
            self.running
                .iter()
                .position(|r| r.active.id == id)
                .expect("the request is running")
        };
        let r = &mut self.running[i];
        match family.export(&mut r.active) {
            Ok(state) => {
                r.parked = true;
                // Whatever its last tick produced goes out first.
                let pending: Vec<Event> = r.active.outbox.events.drain(..).collect();
                for ev in pending {
                    if let Event::Tokens(ids) = &ev {
                        r.generated += ids.len();
                    }
                    r.backlog.push_back(ev);
                }
                r.backlog.push_back(Event::Parked);
                let carried = Carried {
                    prompt_tokens: r.prompt_tokens as usize,
                    generated: r.generated,
                    ticks: r.prior.ticks + r.active.ticks,
                    queue_time: r.queue_time,
                    compute_time: r.prior.compute_time
                        + now.saturating_duration_since(r.active.admitted_at),
                    migrations: r.prior.migrations + 1,
                };
                tracing::debug!(parent: &r.span, request = %id, bytes = state.len(), "exported");
                Ok(Exported { state, carried })
            }
            Err(e) => {
                // It stays here: preempted, it resumes as any preempted request does.
                let r = self.running.remove(i);
                let at = self
                    .preempted
                    .partition_point(|p| p.active.seq < r.active.seq);
                self.preempted.insert(at, r);
                Err(EngineError::CannotMove(format!(
                    "request {id} cannot be exported: {e}"
                )))
            }
        }
    }

    /// Settles the move of exported request `id`: `moved`, it leaves (its stream here ends with
    /// [`EngineError::Moved`]); otherwise it resumes here as a preempted request would.
    pub fn finish_export(&mut self, id: RequestId, moved: bool) -> Result<(), EngineError> {
        let Some(i) = self
            .running
            .iter()
            .position(|r| r.active.id == id && r.parked)
        else {
            return Err(EngineError::NotFound(format!(
                "no exported request {id} waits here (it was settled, cancelled or expired)"
            )));
        };
        if moved {
            let r = &mut self.running[i];
            r.active.outbox.moved();
            tracing::debug!(parent: &r.span, request = %id, "moved to another worker");
        } else {
            let mut r = self.running.remove(i);
            r.parked = false;
            let at = self
                .preempted
                .partition_point(|p| p.active.seq < r.active.seq);
            tracing::debug!(parent: &r.span, request = %id, "move called off; resuming here");
            self.preempted.insert(at, r);
        }
        Ok(())
    }

    /// Fails everything (engine shutting down).
    pub fn abort_all<F: Family<Program = P>>(&mut self, family: &mut F) {
        let waiting = self.queue.lock().drain_where(|_| true);
        for mut w in waiting {
            let _ = w.sink.try_send(Event::Failed(EngineError::ShutDown));
        }
        while let Some(mut r) = self.running.pop().or_else(|| self.preempted.pop()) {
            let _ = r.sink.try_send(Event::Failed(EngineError::ShutDown));
            self.retire(family, r);
        }
        for c in self.cache.drain() {
            self.evict(family, c);
        }
    }
}

/// Sends `r`'s backlog until its sink is full, and notes since when it has been paused (a
/// backlog left over); `true` when the sink is closed (the client went away).
fn drain_backlog<P>(r: &mut Running<P>, now: Instant) -> bool {
    let mut closed = false;
    while let Some(ev) = r.backlog.pop_front() {
        match r.sink.try_send(ev) {
            Ok(()) => {}
            Err((SinkError::Full, ev)) => {
                r.backlog.push_front(ev);
                break;
            }
            Err((SinkError::Closed, _)) => {
                closed = true;
                break;
            }
        }
    }
    if r.backlog.is_empty() {
        r.paused_since = None;
    } else {
        r.paused_since.get_or_insert(now);
    }
    closed
}

/// Why `r` leaves now, if it does: its client went away, its deadline passed, or its
/// client has left its events unread past the write timeout (a request being moved is
/// settled by its export instead).
fn leaves<P>(r: &Running<P>, now: Instant, write_timeout: Option<Duration>) -> Option<Leave> {
    if r.sink.is_closed() {
        Some(Leave::Closed)
    } else if r.deadline.is_some_and(|d| d <= now) {
        Some(Leave::Expired)
    } else if !r.parked
        && write_timeout.is_some_and(|t| {
            r.paused_since
                .is_some_and(|p| now.saturating_duration_since(p) >= t)
        })
    {
        Some(Leave::Stalled)
    } else {
        None
    }
}
