//! The recurrent-depth family behind the real engine thread: batch invariance under continuous
//! batching, slot accounting under random mixes and cancellations (proptest), and the latent
//! slots of diffusion forcing with the occupancy multiplier.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{Receiver, TryRecvError};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Result};
use proptest::prelude::*;
use wavefront_engine::{
    Active, Demand, EngineError, Event, Family, FamilyError, Group, Moved, Planned, RequestId,
    SlotId,
};
use wavefront_models::transformer::PAGE_SIZE;
use wavefront_models::Huginn;

use super::test_support::*;
use super::{serve_family, HuginnFamily, Program};
use crate::options::LoadOptions;
use crate::registry::load_model;
use crate::request::{
    ArParams, DiffusionForcingParams, FreezeTest, GenerateSpec, SamplingParams, SchemeParams,
};
use crate::served::{Planner, ServedModel};
use crate::test_support::{
    assert_joining_requests_match_alone, collect, refusal, serve, submit, wait_for_free_slots,
};
use crate::SchemeError;

/// Sixteen requests covering both schemes and their options, with different prompt lengths.
fn mixed_requests() -> Vec<GenerateSpec> {
    use FreezeTest::{Aligned, Upstream};
    let df = |w, f| SchemeParams::DiffusionForcing(diffusion(w, f));
    let sampled = |mut s: GenerateSpec, temperature| {
        s.sampling = SamplingParams {
            temperature,
            top_k: 0,
            top_p: 0.9,
            seed: s.sampling.seed,
            ..SamplingParams::default()
        };
        s
    };
    let mut specs = vec![
        spec(prompt(5, 0), 12, 1, ar_static(4, "full")),
        spec(prompt(12, 1), 10, 2, ar_static(8, "latest-m4-compress-s4")),
        spec(prompt(3, 2), 12, 3, ar_static(6, "latest-m4-compress-s16")),
        spec(prompt(9, 3), 10, 4, ar_adaptive(32, "latest-m4", 0.03)),
        spec(
            prompt(7, 4),
            12,
            5,
            ar_adaptive(32, "latest-m4-compress-s4", 0.05),
        ),
        sampled(spec(prompt(6, 5), 12, 42, ar_static(4, "full")), 0.8),
        spec(prompt(10, 6), 12, 7, df(8, Aligned)),
        spec(prompt(6, 7), 12, 8, df(32, Upstream)),
        spec(
            prompt(4, 8),
            10,
            9,
            SchemeParams::DiffusionForcing(DiffusionForcingParams {
                ema_embeds: 0.0,
                state_noise_mixing: 0.5,
                ..diffusion(16, Aligned)
            }),
        ),
        sampled(spec(prompt(8, 9), 10, 10, df(16, Aligned)), 0.7),
    ];
    let cc_ar = |steps, eps| {
        SchemeParams::Ar(ArParams {
            num_steps: Some(steps),
            cache_lookup_strategy: Some("latest-m4".into()),
            exit_threshold: eps,
            continuous_compute: true,
            ..ArParams::default()
        })
    };
    specs.push(spec(prompt(8, 10), 12, 11, cc_ar(8, None)));
    specs.push(spec(prompt(11, 11), 10, 12, cc_ar(32, Some(0.03))));
    specs.push(spec(
        prompt(5, 12),
        12,
        13,
        SchemeParams::DiffusionForcing(DiffusionForcingParams {
            continuous_compute: true,
            ..diffusion(16, Aligned)
        }),
    ));
    specs.push(spec(
        prompt(7, 13),
        12,
        14,
        SchemeParams::DiffusionForcing(DiffusionForcingParams {
            headway: 2,
            ..diffusion(16, Aligned)
        }),
    ));
    specs.push(spec(
        prompt(2, 14),
        8,
        15,
        SchemeParams::Ar(ArParams {
            num_steps: Some(2),
            init_scale: Some(0.0),
            ..ArParams::default()
        }),
    ));
    specs.push(spec(
        prompt(13, 15),
        10,
        16,
        SchemeParams::DiffusionForcing(DiffusionForcingParams {
            init_scale: 0.0,
            ..diffusion(8, Upstream)
        }),
    ));
    specs
}

/// The most slots any of `specs` may hold over its life (float32 pages of the fixture).
fn largest_request(specs: &[GenerateSpec]) -> Result<usize> {
    let (_, planner) = fixture_model_and_planner()?;
    Ok(specs
        .iter()
        .map(|s| planner.prepare(s.clone()).map(|p| p.max_slots))
        .collect::<Result<Vec<_>, _>>()?
        .into_iter()
        .max()
        .unwrap_or(1))
}

fn fixture_served(max_active: usize) -> Result<Arc<dyn ServedModel>> {
    serve(fixture_files()?, "fixture", max_active)
}

#[test]
fn requests_arriving_at_different_ticks_produce_what_they_produce_alone() -> Result<()> {
    let specs = mixed_requests();
    assert_eq!(specs.len(), 16);
    let served = fixture_served(specs.len())?;
    // Request i joins once request i - 1 has streamed a token, so every request is admitted
    // into a batch that is already running, mid-prefill or mid-wavefront for the others.
    let alone = assert_joining_requests_match_alone(served.as_ref(), &specs, |ev| {
        matches!(ev, Event::Tokens(_))
    })?;
    // The mix really was mixed: every scheme variant produced tokens.
    ensure!(alone.iter().all(|o| !o.tokens.is_empty()));
    served.shutdown();
    Ok(())
}

/// The sixteen mixed requests (every scheme and cache strategy, greedy and seeded) at once on a
/// pool a little larger than the largest request's worst case: pages are taken as caches grow,
/// requests are preempted (pages and latent states to host memory) and resumed in other pages,
/// and each produces exactly what it produces alone with room to spare.
#[test]
fn requests_preempted_for_pages_produce_what_they_produce_alone() -> Result<()> {
    let specs = mixed_requests();
    let largest = largest_request(&specs)?;
    let cfg = fixture_config()?;
    let page_bytes = (PAGE_SIZE * 2 * cfg.n_embd * 4) as u64;
    let roomy = fixture_served(specs.len())?;
    let preemptions = crate::test_support::assert_preempted_requests_match_alone(
        fixture_files()?,
        roomy.as_ref(),
        (largest as u64 + 16) * page_bytes,
        &specs,
    )?;
    ensure!(
        preemptions > 0,
        "16 requests on {} pages must preempt",
        largest + 16
    );
    roomy.shutdown();
    Ok(())
}

/// A row budget of 16 per tick: static prefills of 30 to 60 positions run in chunks, with
/// continuous compute, shared caches and sampling, beside adaptive prefills and wavefronts that
/// run whole; each request produces what it produces without a budget. A request decoding
/// when a 120-position prompt arrives keeps streaming through that prompt's chunks.
#[test]
fn long_prefills_run_in_chunks_without_changing_tokens_or_stalling_decodes() -> Result<()> {
    let cc = SchemeParams::Ar(ArParams {
        num_steps: Some(4),
        cache_lookup_strategy: Some("latest-m4".into()),
        continuous_compute: true,
        ..ArParams::default()
    });
    let mut sampled = spec(prompt(45, 3), 8, 21, ar_static(4, "full"));
    sampled.sampling.temperature = 0.8;
    let specs = vec![
        spec(prompt(40, 0), 8, 1, ar_static(4, "full")),
        spec(prompt(60, 1), 6, 2, ar_static(3, "latest-m4-compress-s4")),
        spec(prompt(33, 2), 8, 3, cc),
        sampled,
        spec(prompt(50, 4), 6, 5, ar_adaptive(8, "latest-m4", 0.05)),
        spec(
            prompt(30, 5),
            8,
            6,
            SchemeParams::DiffusionForcing(diffusion(8, FreezeTest::Aligned)),
        ),
        spec(prompt(3, 6), 10, 7, ar_static(2, "full")),
    ];
    let roomy = fixture_served(specs.len())?;
    crate::test_support::assert_chunked_prefill_matches(
        fixture_files()?,
        roomy.as_ref(),
        16,
        &specs,
        (
            spec(prompt(120, 7), 4, 8, ar_static(2, "full")),
            spec(prompt(4, 8), 64, 9, ar_static(2, "full")),
            5,
        ),
        &[],
    )?;
    roomy.shutdown();
    Ok(())
}

/// Which slots each live request holds, as the family sees them at every tick.
#[derive(Default)]
struct Ledger {
    live: HashMap<RequestId, Vec<SlotId>>,
    /// The most slots each request held.
    reserved: HashMap<RequestId, usize>,
    released: HashSet<RequestId>,
    violations: Vec<String>,
}

/// The Huginn family, auditing slot ownership before every tick and at every release: a
/// running request's slots only grow (it gives them up only when preempted), and no slot is
/// held by two requests.
struct Audited {
    inner: HuginnFamily,
    ledger: Arc<Mutex<Ledger>>,
}

impl Family for Audited {
    type Program = Program;
    type Plan = <HuginnFamily as Family>::Plan;
    type Output = <HuginnFamily as Family>::Output;

    fn demand(&self, a: &Active<Program>) -> Demand {
        self.inner.demand(a)
    }

    fn plan(
        &mut self,
        a: &mut Active<Program>,
        rows: usize,
    ) -> Result<Option<Self::Plan>, FamilyError> {
        {
            let mut l = self.ledger.lock().expect("ledger");
            let held = l.live.get(&a.id).cloned().unwrap_or_default();
            if !a.slots.starts_with(&held) {
                let msg = format!("{} lost slots while running", a.id);
                l.violations.push(msg);
            }
            let mine: HashSet<SlotId> = a.slots.iter().copied().collect();
            if mine.len() != a.slots.len() {
                let msg = format!("{} holds a slot twice", a.id);
                l.violations.push(msg);
            }
            let clash: Vec<String> = l
                .live
                .iter()
                .filter(|(other, s)| **other != a.id && s.iter().any(|x| mine.contains(x)))
                .map(|(other, _)| format!("{} shares a slot with {other}", a.id))
                .collect();
            l.violations.extend(clash);
            l.live.insert(a.id, a.slots.clone());
            let most = l.reserved.entry(a.id).or_default();
            *most = (*most).max(a.slots.len());
        }
        self.inner.plan(a, rows)
    }

    fn run(&mut self, work: &mut [Planned<'_, Program, Self::Plan>]) -> Vec<Group<Self::Output>> {
        self.inner.run(work)
    }

    fn commit(
        &mut self,
        a: &mut Active<Program>,
        plan: Self::Plan,
        output: Self::Output,
    ) -> Result<(), FamilyError> {
        self.inner.commit(a, plan, output)
    }

    fn release(&mut self, a: &mut Active<Program>) {
        let mut l = self.ledger.lock().expect("ledger");
        l.live.remove(&a.id);
        if !l.released.insert(a.id) {
            let msg = format!("{} released twice", a.id);
            l.violations.push(msg);
        }
        drop(l);
        self.inner.release(a);
    }

    fn slots_needed(&self, a: &Active<Program>) -> usize {
        self.inner.slots_needed(a)
    }

    fn preempt(&mut self, a: &mut Active<Program>) -> Result<Moved, FamilyError> {
        self.ledger.lock().expect("ledger").live.remove(&a.id);
        self.inner.preempt(a)
    }

    fn resume(&mut self, a: &mut Active<Program>) -> Result<Moved, FamilyError> {
        self.inner.resume(a)
    }
}

#[derive(Debug, Clone)]
enum Cancel {
    None,
    /// Drop the receiver after this many events (the engine notices when a send fails).
    DropReceiver(usize),
    /// Mark the sink closed after this many events (the engine notices at its next reap).
    CloseSink(usize),
}

fn random_scheme() -> impl Strategy<Value = SchemeParams> {
    prop_oneof![
        (1usize..6, prop::bool::ANY, prop::bool::ANY).prop_map(|(steps, share, cc)| {
            SchemeParams::Ar(ArParams {
                num_steps: Some(steps),
                cache_lookup_strategy: Some(
                    if share {
                        "latest-m4-compress-s4"
                    } else {
                        "full"
                    }
                    .into(),
                ),
                continuous_compute: cc,
                ..ArParams::default()
            })
        }),
        (4usize..12).prop_map(|steps| ar_adaptive(steps, "latest-m4", 0.05)),
        (2usize..10, 1usize..3, prop::bool::ANY, prop::bool::ANY).prop_map(
            |(w, headway, upstream, cc)| {
                let f = if upstream {
                    FreezeTest::Upstream
                } else {
                    FreezeTest::Aligned
                };
                SchemeParams::DiffusionForcing(DiffusionForcingParams {
                    num_steps: Some(4),
                    headway: headway.min(w),
                    continuous_compute: cc,
                    ..diffusion(w, f)
                })
            }
        ),
    ]
}

fn random_request() -> impl Strategy<Value = (GenerateSpec, Cancel, usize)> {
    let cancel = prop_oneof![
        Just(Cancel::None),
        (0usize..4).prop_map(Cancel::DropReceiver),
        (0usize..4).prop_map(Cancel::CloseSink),
    ];
    (
        1usize..10,
        1usize..6,
        any::<u64>(),
        random_scheme(),
        cancel,
        1usize..4,
    )
        .prop_map(|(len, max_new, seed, scheme, cancel, capacity)| {
            (
                spec(prompt(len, seed as u32 % 97), max_new, seed, scheme),
                cancel,
                capacity,
            )
        })
}

struct Client {
    rx: Option<Receiver<Event>>,
    /// The receiver of a client that closed its sink, kept alive but no longer read.
    parked: Option<Receiver<Event>>,
    closed: Arc<AtomicBool>,
    cancel: Cancel,
    events: usize,
    done: bool,
}

impl Client {
    fn maybe_cancel(&mut self) {
        match self.cancel {
            Cancel::DropReceiver(n) if self.events >= n => {
                self.rx = None;
                self.done = true;
            }
            Cancel::CloseSink(n) if self.events >= n => {
                self.closed.store(true, Ordering::Release);
                self.parked = self.rx.take();
                self.done = true;
            }
            _ => {}
        }
    }
}

/// Serves `requests` on a pool that holds `pool_requests` of the largest one, cancelling as
/// told, then checks the ledger and that every slot came back.
fn run_mix(
    requests: Vec<(GenerateSpec, Cancel, usize)>,
    pool_requests: usize,
    max_active: usize,
) -> Result<()> {
    let files = fixture_files()?;
    let cfg = fixture_config()?;
    let planner = super::HuginnPlanner::new(cfg.clone(), "fixture".into(), None);
    let largest = requests
        .iter()
        .map(|(s, _, _)| planner.prepare(s.clone()).map(|p| p.max_slots))
        .collect::<Result<Vec<_>, _>>()?
        .into_iter()
        .max()
        .unwrap_or(1);
    let bytes_per_slot = PAGE_SIZE * 2 * cfg.n_embd * 4;
    let opts = LoadOptions {
        name: "fixture".into(),
        memory_budget_bytes: (largest * pool_requests * bytes_per_slot) as u64,
        max_active,
        ..LoadOptions::default()
    };
    let ledger = Arc::new(Mutex::new(Ledger::default()));
    let audit = ledger.clone();
    let model_cfg = cfg.clone();
    let served = serve_family(cfg, None, opts, move |device, dtype| {
        let vb = files.var_builder(dtype, device)?;
        let model = Huginn::load(vb, model_cfg)?;
        Ok(Audited {
            inner: HuginnFamily::new(model),
            ledger: audit,
        })
    })?;
    let total = served.load().total_slots;
    ensure!(total == largest * pool_requests, "pool of {total} slots");

    let mut expected: HashMap<RequestId, usize> = HashMap::new();
    let mut clients = Vec::new();
    for (spec, cancel, capacity) in requests {
        let (sink, rx, closed) = TestSink::new(capacity);
        let slots = planner.prepare(spec.clone())?.max_slots;
        let id = served.submit(spec, Box::new(sink), None, tracing::Span::none())?;
        expected.insert(id, slots);
        let mut c = Client {
            rx: Some(rx),
            parked: None,
            closed,
            cancel,
            events: 0,
            done: false,
        };
        c.maybe_cancel();
        clients.push(c);
    }
    let deadline = Instant::now() + Duration::from_secs(120);
    while clients.iter().any(|c| !c.done) {
        ensure!(Instant::now() < deadline, "requests did not finish");
        let mut progressed = false;
        for c in clients.iter_mut().filter(|c| !c.done) {
            let Some(rx) = &c.rx else { continue };
            match rx.try_recv() {
                Ok(ev) => {
                    progressed = true;
                    c.events += 1;
                    match ev {
                        Event::Tokens(_)
                        | Event::Canvas(_)
                        | Event::Logprobs(_)
                        | Event::PromptLogprobs(_)
                        | Event::Parked => {}
                        Event::Finished { .. } => c.done = true,
                        Event::Failed(e) => bail!("request failed: {e}"),
                    }
                    if !c.done {
                        c.maybe_cancel();
                    }
                }
                Err(TryRecvError::Empty) => {}
                Err(TryRecvError::Disconnected) => bail!("engine dropped a live request"),
            }
        }
        if !progressed {
            std::thread::sleep(Duration::from_millis(1));
        }
    }
    // Cancelled requests leave at the engine's next look at them; then the pool is whole.
    loop {
        let load = served.load();
        if load.active == 0 && load.queued == 0 && load.free_slots == load.total_slots {
            break;
        }
        ensure!(Instant::now() < deadline, "slots not returned: {load:?}");
        std::thread::sleep(Duration::from_millis(1));
    }
    served.shutdown();
    let l = ledger.lock().expect("ledger");
    ensure!(l.violations.is_empty(), "{:?}", l.violations);
    ensure!(l.live.is_empty(), "never released: {:?}", l.live.keys());
    for (id, n) in &l.reserved {
        ensure!(
            expected.get(id).is_some_and(|most| n <= most),
            "{id} held {n} slots, at most {:?}",
            expected.get(id)
        );
        ensure!(l.released.contains(id), "{id} not released");
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(12))]

    #[test]
    fn no_slot_is_shared_and_every_slot_returns(
        requests in proptest::collection::vec(random_request(), 1..8),
        pool_requests in 1usize..3,
        max_active in 1usize..5,
    ) {
        run_mix(requests, pool_requests, max_active)
            .map_err(|e| TestCaseError::fail(format!("{e:#}")))?;
    }
}

#[test]
fn diffusion_reserves_latent_slots_scaled_by_the_occupancy_multiplier() -> Result<()> {
    let cfg = fixture_config()?;
    let (prompt_len, max_new, w) = (6, 10, 12);
    let df = spec(
        prompt(prompt_len, 0),
        max_new,
        1,
        SchemeParams::DiffusionForcing(diffusion(w, FreezeTest::Aligned)),
    );
    // Slots are pages of 16 positions of one cache layer (or 16 latent states).
    // compress-s4: prelude 2 + coda 2 + 4 shared core layers.
    let kv = (prompt_len + max_new + w).div_ceil(PAGE_SIZE) * 8;
    for (m, latent) in [(1.0f32, 12_usize), (1.5, 18), (0.25, 3), (0.3, 4)] {
        let planner =
            super::HuginnPlanner::new(cfg.clone(), "f".into(), None).with_occupancy_multiplier(m);
        let p = planner.prepare(df.clone())?;
        let latent = latent.div_ceil(PAGE_SIZE);
        ensure!(
            p.max_slots == kv + latent,
            "multiplier {m}: {} slots at most, want {kv} + {latent}",
            p.max_slots
        );
        // Admission takes the prefill's: the prompt's pages, and a latent page for the first
        // state (the wave grows from there).
        ensure!(p.slots == prompt_len.div_ceil(PAGE_SIZE) * 8 + 1);
        // AR requests hold no latent slots: full cache, 4 steps = 2 + 2 + 16 layers.
        let ar = planner.prepare(spec(
            prompt(prompt_len, 0),
            max_new,
            1,
            ar_static(4, "full"),
        ))?;
        ensure!(ar.max_slots == (prompt_len + max_new).div_ceil(PAGE_SIZE) * 20);
        ensure!(ar.slots == prompt_len.div_ceil(PAGE_SIZE) * 20);
    }

    // Served: the pool comes from the memory budget; a request fits exactly with multiplier 1
    // and is refused at once when the multiplier makes it larger than the pool.
    let budget_slots = kv + w.div_ceil(PAGE_SIZE);
    let opts = |m: f32| LoadOptions {
        name: "fixture".into(),
        memory_budget_bytes: (budget_slots * PAGE_SIZE * 2 * cfg.n_embd * 4) as u64,
        occupancy_multiplier: m,
        ..LoadOptions::default()
    };
    let served = load_model(fixture_files()?, opts(1.0))?;
    ensure!(served.load().total_slots == budget_slots);
    let out = collect(&submit(served.as_ref(), df.clone())?, Vec::new())?;
    ensure!(out.tokens.len() == max_new);
    served.shutdown();
    let served = load_model(fixture_files()?, opts(2.0))?;
    match refusal(served.as_ref(), df)? {
        EngineError::TooLarge { needed, total } => {
            ensure!((needed, total) == (kv + (2 * w).div_ceil(PAGE_SIZE), budget_slots));
        }
        other => bail!("expected TooLarge, got {other:?}"),
    }
    served.shutdown();
    for bad in [0.0, -1.0, f32::NAN, f32::INFINITY] {
        match load_model(fixture_files()?, opts(bad)) {
            Err(SchemeError::InvalidOption(_)) => {}
            Err(e) => bail!("multiplier {bad}: {e}"),
            Ok(_) => bail!("multiplier {bad} accepted"),
        }
    }
    Ok(())
}

/// `--kv-cache-dtype bf16`: the pool holds twice the pages in the same budget (a page is half
/// the bytes, a latent state two of its rows), and the sixteen mixed requests produce what they
/// produce alone when they join a running batch, when they are preempted (K/V pages and the
/// latent states stored in them to host memory and back) and when they move between two such
/// engines. An engine storing float32 does not take their requests. Every request stays within
/// bf16 rounding of float32: the greedy tokens of the static requests mostly agree.
#[test]
fn bf16_kv_pages_serve_the_mix_batched_preempted_and_moved_alike() -> Result<()> {
    use crate::options::KvCacheDtype;
    let specs = mixed_requests();
    let cfg = fixture_config()?;
    let page_bytes = (PAGE_SIZE * 2 * cfg.n_embd * 2) as u64;
    let base = LoadOptions {
        name: "fixture".into(),
        kv_cache_dtype: KvCacheDtype::Bf16,
        ..LoadOptions::default()
    };
    let served = load_model(
        fixture_files()?,
        LoadOptions {
            max_active: specs.len(),
            ..base.clone()
        },
    )?;
    let float = fixture_served(specs.len())?;
    ensure!(
        served.load().total_slots == 2 * float.load().total_slots,
        "bf16 pages: {} slots, float32 {}",
        served.load().total_slots,
        float.load().total_slots
    );
    ensure!(
        served.migration_key().map_err(anyhow::Error::msg)?
            != float.migration_key().map_err(anyhow::Error::msg)?,
        "engines storing K/V differently must not take each other's requests"
    );
    let alone = assert_joining_requests_match_alone(served.as_ref(), &specs, |ev| {
        matches!(ev, Event::Tokens(_))
    })?;
    ensure!(alone.iter().all(|o| !o.tokens.is_empty()));
    // Against float32: the first greedy static request (4 steps, full cache) decodes the same
    // first tokens (bf16 keys move its logits by a few thousandths on this fixture).
    let f = collect(&submit(float.as_ref(), specs[0].clone())?, Vec::new())?;
    ensure!(
        f.tokens[..4] == alone[0].tokens[..4],
        "bf16 K/V {:?}, float32 {:?}",
        alone[0].tokens,
        f.tokens
    );
    float.shutdown();
    let largest = largest_request(&specs)?;
    // Latent states take two rows each here: twice float32's latent pages at most.
    let preemptions = crate::test_support::assert_preempted_requests_match_alone_with(
        fixture_files()?,
        served.as_ref(),
        (2 * largest as u64 + 16) * page_bytes,
        &specs,
        base.clone(),
    )?;
    ensure!(preemptions > 0, "16 requests on a tight pool must preempt");
    crate::test_support::assert_moved_requests_match_alone_with(
        fixture_files()?,
        served.as_ref(),
        &specs,
        base,
    )?;
    served.shutdown();
    Ok(())
}

/// The served model split over 2 and 4 in-process tensor-parallel ranks decodes what one rank
/// decodes (static, adaptive and diffusion-forcing requests sharing ticks).
#[test]
fn tensor_parallel_serving_decodes_what_one_rank_decodes() -> Result<()> {
    crate::test_support::assert_tensor_parallel_decodes_match(fixture_files, &mixed_requests())
}

/// A transport's stop (a stop string) finishes AR and diffusion-forcing requests with their
/// statistics so far (recurrence steps; the sampler's frozen positions).
#[test]
fn a_transport_stop_finishes_with_the_programs_stats() -> Result<()> {
    let served = fixture_served(2)?;
    crate::test_support::assert_stop_finishes_with_stats(
        served.as_ref(),
        spec(prompt(5, 0), 12, 1, ar_static(4, "full")),
        |st| {
            ensure!(st.recurrence_steps == 4 * st.forward_passes && st.forward_passes > 0);
            Ok(())
        },
    )?;
    crate::test_support::assert_stop_finishes_with_stats(
        served.as_ref(),
        spec(
            prompt(10, 6),
            12,
            7,
            SchemeParams::DiffusionForcing(diffusion(8, FreezeTest::Aligned)),
        ),
        |st| {
            ensure!(st.counters.contains_key("frozen_positions") && st.forward_passes > 0);
            Ok(())
        },
    )?;
    Ok(())
}

/// A forward that fails fails only the requests in it: with a static-AR and a diffusion-forcing
/// request in the same ticks, a failure of the diffusion group's forward fails that request
/// (a typed `FamilyError::Forward`), and the AR request produces what it produces alone.
#[test]
fn a_failed_forward_fails_only_the_requests_in_it() -> Result<()> {
    let ar_spec = spec(prompt(5, 0), 24, 1, ar_static(4, "full"));
    let df_spec = spec(
        prompt(6, 7),
        12,
        8,
        SchemeParams::DiffusionForcing(diffusion(8, FreezeTest::Aligned)),
    );
    let alone = {
        let served = fixture_served(4)?;
        let rx = submit(served.as_ref(), ar_spec.clone())?;
        let out = collect(&rx, Vec::new())?;
        served.shutdown();
        out.tokens
    };
    let files = fixture_files()?;
    let cfg = fixture_config()?;
    let model_cfg = cfg.clone();
    let opts = LoadOptions {
        name: "fixture".into(),
        max_active: 4,
        ..LoadOptions::default()
    };
    let served = serve_family(cfg, None, opts, move |device, dtype| {
        let vb = files.var_builder(dtype, device)?;
        let model = Huginn::load(vb, model_cfg)?;
        let mut family = HuginnFamily::new(model);
        family.fail_next = Some("diffusion-forcing");
        Ok(family)
    })?;
    // The AR request first: it is still decoding (24 tokens) when the diffusion request joins,
    // so the failing forward runs in a tick the AR request shares.
    let ar_rx = submit(served.as_ref(), ar_spec)?;
    let df_rx = submit(served.as_ref(), df_spec)?;
    let failed = loop {
        match df_rx.recv_timeout(Duration::from_secs(60))? {
            Event::Failed(e) => break e,
            Event::Finished { .. } => {
                bail!("the diffusion request finished despite its failed forward")
            }
            Event::Tokens(_)
            | Event::Canvas(_)
            | Event::Logprobs(_)
            | Event::PromptLogprobs(_)
            | Event::Parked => {}
        }
    };
    match &failed {
        EngineError::StepFailed(FamilyError::Forward(m)) => {
            ensure!(
                m.to_string()
                    .contains("injected failure of the diffusion-forcing forward"),
                "{m}"
            )
        }
        other => bail!("unexpected failure {other:?}"),
    }
    let ar = collect(&ar_rx, Vec::new())?;
    ensure!(ar.tokens == alone, "{:?} != {alone:?}", ar.tokens);
    let start = Instant::now();
    loop {
        let load = served.load();
        if load.active == 0 && load.free_slots == load.total_slots {
            break;
        }
        ensure!(
            start.elapsed() < Duration::from_secs(20),
            "slots not returned: {load:?}"
        );
        std::thread::sleep(Duration::from_millis(1));
    }
    served.shutdown();
    Ok(())
}

/// Every request of the mix, moved to a second engine of the same checkpoint after its first
/// event and back after its next (stopped at a step boundary, its state exported and resumed in
/// other slots), produces exactly what it produces alone: tokens, finish reason and every
/// statistic but timing, with its moves counted.
#[test]
fn requests_moved_between_workers_produce_what_they_produce_alone() -> Result<()> {
    let specs = mixed_requests();
    let served = fixture_served(specs.len())?;
    crate::test_support::assert_moved_requests_match_alone(
        fixture_files()?,
        served.as_ref(),
        &specs,
    )?;
    served.shutdown();
    Ok(())
}

/// A fault in one request's plan, forward or commit fails that request only: both schemes, each
/// beside a request of the other scheme (another forward group) and of its own (the same one).
#[test]
fn an_injected_fault_fails_only_its_request() -> Result<()> {
    let (model, planner) = fixture_model_and_planner()?;
    let ar = |salt| spec(prompt(5, salt), 6, 1, ar_static(4, "full"));
    let df = spec(
        prompt(6, 7),
        6,
        8,
        SchemeParams::DiffusionForcing(diffusion(8, FreezeTest::Aligned)),
    );
    for (faulty, ok) in [(ar(0), df.clone()), (df.clone(), ar(3)), (ar(1), ar(2))] {
        crate::fault_tests::assert_faults_fail_only_their_request(
            || Ok(HuginnFamily::new(model.clone())),
            || Ok(planner.prepare(faulty.clone())?.program),
            || Ok(planner.prepare(ok.clone())?.program),
        )?;
    }
    Ok(())
}

/// Clients that stop reading cannot hold the engine: eight requests whose one-event buffers
/// nobody reads pause holding the whole of a small pool; a new request preempts some of them
/// (their state to host memory) instead of waiting behind them, and finishes with its own tokens
/// within twice its unloaded latency (20 ms of slack for the other tests on these cores). Both
/// sides are medians, so one time slice lost to another test decides neither: the unloaded
/// latency of five requests, the loaded one of three rounds, each with eight new stalled clients
/// filling the pool and its own preemptions. When the eight clients go, every slot comes back.
#[test]
fn clients_that_do_not_read_cannot_hold_the_engine() -> Result<()> {
    let stalled_spec = |i: u32| spec(prompt(48, i + 3), 200, u64::from(i), ar_static(4, "full"));
    let fresh = spec(prompt(6, 1), 8, 1, ar_static(4, "full"));
    let cfg = fixture_config()?;
    let planner = super::HuginnPlanner::new(cfg.clone(), "fixture".into(), None);
    let first = planner.prepare(stalled_spec(0))?.slots;
    let bytes_per_slot = PAGE_SIZE * 2 * cfg.n_embd * 4;
    let opts = LoadOptions {
        name: "fixture".into(),
        // Eight prompts' pages: the eight stalled requests fill the pool.
        memory_budget_bytes: (8 * first * bytes_per_slot) as u64,
        max_active: 16,
        ..LoadOptions::default()
    };
    let served = load_model(fixture_files()?, opts)?;
    // The engine is idle for a while before the new request in both cases (all the others
    // paused, or nothing running): on these VMs a forward after an idle spell takes up to
    // four times one after a busy one, so both latencies are taken after the same pause.
    let settle = Duration::from_millis(50);
    let latency = |served: &dyn ServedModel| -> Result<(Duration, Vec<u32>)> {
        std::thread::sleep(settle);
        let t = Instant::now();
        let out = collect(&submit(served, fresh.clone())?, Vec::new())?;
        Ok((t.elapsed(), out.tokens))
    };
    latency(served.as_ref())?;
    let mut runs = (0..5)
        .map(|_| latency(served.as_ref()))
        .collect::<Result<Vec<_>>>()?;
    runs.sort();
    let (alone, want) = runs.swap_remove(2);
    let mut loaded = Vec::new();
    for round in 0..3u32 {
        let mut stalled = Vec::new();
        for i in 0..8 {
            let (sink, rx, _) = TestSink::new(1);
            served.submit(
                stalled_spec(8 * round + i),
                Box::new(sink),
                None,
                tracing::Span::none(),
            )?;
            stalled.push(rx);
        }
        let start = Instant::now();
        while served.load().free_slots > 0 {
            ensure!(
                start.elapsed() < Duration::from_secs(30),
                "the stalled requests did not fill the pool: {:?}",
                served.load()
            );
            std::thread::sleep(Duration::from_millis(5));
        }
        let held = served.load();
        let (took, got) = latency(served.as_ref())?;
        println!(
            "round {round}: a new request beside eight stalled clients: {took:?} ({alone:?} \
             alone); the stalled held {} of {} slots; {} preemptions before it, {} after",
            held.total_slots - held.free_slots,
            held.total_slots,
            held.preemptions,
            served.load().preemptions
        );
        ensure!(got == want, "round {round}: {got:?} vs {want:?}");
        ensure!(
            served.load().preemptions > held.preemptions,
            "round {round}: the new request preempted no one: {:?}",
            served.load()
        );
        loaded.push(took);
        drop(stalled);
        wait_for_free_slots(served.as_ref(), Duration::from_secs(30))?;
    }
    loaded.sort();
    ensure!(
        loaded[1] <= alone * 2 + Duration::from_millis(20),
        "{loaded:?} beside eight stalled clients (median {:?}), {alone:?} alone",
        loaded[1]
    );
    served.shutdown();
    Ok(())
}

/// Diffusion-forcing requests (the soak's mix: default options, 1 to 15 tokens) beside static
/// `ar` ones, whose clients stop reading after their first event for up to 200 ms: every
/// request finishes, none fails for want of pages. (The full soak found one that did: a wave
/// that shrank was granted pages for its smaller latent rows while its forward still held the
/// larger ones, which are rewritten only at the commit.)
#[test]
fn stalled_readers_beside_diffusion_forcing_requests_all_finish() -> Result<()> {
    let served = load_model(
        fixture_files()?,
        LoadOptions {
            name: "fixture".into(),
            max_active: 32,
            ..LoadOptions::default()
        },
    )?;
    let mut readers = Vec::new();
    for i in 0..96u32 {
        let scheme = if i % 3 == 0 {
            ar_static(4, "full")
        } else {
            SchemeParams::DiffusionForcing(DiffusionForcingParams {
                num_steps: Some(8),
                ..DiffusionForcingParams::default()
            })
        };
        let s = spec(
            prompt(3 + (i as usize * 7) % 20, i),
            1 + (i as usize * 5) % 15,
            u64::from(i),
            scheme,
        );
        let (sink, rx, _) = TestSink::new(1);
        served.submit(s, Box::new(sink), None, tracing::Span::none())?;
        let stall = Duration::from_millis(u64::from(i * 37 % 200));
        readers.push(std::thread::spawn(move || -> Result<()> {
            let first = rx.recv_timeout(Duration::from_secs(60))?;
            std::thread::sleep(stall);
            let out = collect(&rx, vec![first])?;
            ensure!(
                matches!(
                    out.reason,
                    wavefront_engine::FinishReason::Length
                        | wavefront_engine::FinishReason::StopToken
                        | wavefront_engine::FinishReason::ContextLimit
                ),
                "{:?}",
                out.reason
            );
            Ok(())
        }));
        if i % 8 == 7 {
            std::thread::sleep(Duration::from_millis(20));
        }
    }
    for (i, r) in readers.into_iter().enumerate() {
        r.join()
            .expect("reader")
            .map_err(|e| anyhow::anyhow!("request {i}: {e}"))?;
    }
    wait_for_free_slots(served.as_ref(), Duration::from_secs(30))?;
    served.shutdown();
    Ok(())
}
