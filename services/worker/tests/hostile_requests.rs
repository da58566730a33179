//! Hostile input, fuzzed with proptest (a bounded budget here; `PROPTEST_CASES=N` or
//! `scripts/fuzz.sh` for long runs):
//! - protobuf requests, as arbitrary bytes and as arbitrary field values, through decoding,
//!   the worker's limits, conversion and the family's validation on every fixture family: each
//!   ends admitted, or refused with INVALID_ARGUMENT / NOT_FOUND / RESOURCE_EXHAUSTED and a
//!   message; nothing panics;
//! - chat messages through each model's template: a message holding template syntax is data,
//!   rendered verbatim, never executed;
//! - tokenizer input of any text and length: it never panics, and the cheap lower bound the
//!   worker checks before tokenizing never exceeds the real count (so it refuses nothing the
//!   model would take).

use std::sync::{Arc, OnceLock};

use proptest::prelude::*;
use prost::Message;
use tonic::Code;
use wavefront_engine::{Event, EventSink, SinkError};
use wavefront_proto::v1 as pb;
use wavefront_schemes::{load_model, LoadOptions, ServedModel};
use wavefront_worker::{convert, RequestLimits};

const FAMILIES: [&str; 7] = [
    "huginn",
    "llada",
    "armt",
    "refusion",
    "dream",
    "llada2",
    "diffusion_gemma",
];

fn models() -> &'static [Arc<dyn ServedModel>] {
    static MODELS: OnceLock<Vec<Arc<dyn ServedModel>>> = OnceLock::new();
    MODELS.get_or_init(|| {
        FAMILIES
            .iter()
            .map(|f| {
                let dir = wavefront_models::device::test_fixture(f);
                let files = wavefront_models::ModelFiles::from_dir(dir).expect("fixture");
                let opts = LoadOptions {
                    name: (*f).into(),
                    ..LoadOptions::default()
                };
                load_model(files, opts).expect("loads")
            })
            .collect()
    })
}

/// A caller that has already left: an admitted request is dropped at the engine's next tick.
struct Gone;

impl EventSink for Gone {
    fn try_send(&mut self, event: Event) -> Result<(), (SinkError, Event)> {
        Err((SinkError::Closed, event))
    }
    fn is_closed(&self) -> bool {
        true
    }
    fn stop_requested(&self) -> bool {
        false
    }
}

/// The worker's path for one request: limits, conversion (tokenizing, templates), the
/// family's validation and admission. `Ok` when admitted.
fn serve(req: &pb::GenerateRequest, model: &dyn ServedModel) -> Result<(), tonic::Status> {
    // The worker runs this on a blocking-pool thread (2 MiB of stack): so does the test, so
    // input that recursed deeply would overflow here as it would there.
    std::thread::scope(|s| {
        std::thread::Builder::new()
            .stack_size(2 << 20)
            .spawn_scoped(s, || serve_on_this_thread(req, model))
            .expect("thread")
            .join()
            .expect("no panic")
    })
}

fn serve_on_this_thread(
    req: &pb::GenerateRequest,
    model: &dyn ServedModel,
) -> Result<(), tonic::Status> {
    let limits = RequestLimits::default();
    limits.check_fields(req, model)?;
    let spec = convert::spec_from_proto(req, model)?;
    limits.check_prompt(spec.prompt_ids.len())?;
    model
        .submit(spec, Box::new(Gone), None, tracing::Span::none())
        .map(|_| ())
        .map_err(|e| wavefront_worker::status::from_engine_error(&e))
}

fn check_outcome(r: Result<(), tonic::Status>) -> Result<(), TestCaseError> {
    if let Err(s) = r {
        prop_assert!(
            matches!(
                s.code(),
                Code::InvalidArgument | Code::NotFound | Code::ResourceExhausted
            ),
            "undocumented status {:?}: {}",
            s.code(),
            s.message()
        );
        prop_assert!(!s.message().is_empty(), "a refusal without a message");
    }
    Ok(())
}

fn any_text() -> impl Strategy<Value = String> {
    prop_oneof![
        ".{0,64}",
        "[a-z ]{0,400}",
        Just(String::new()),
        "\\PC{0,200}",
        // Template and tokenizer specials.
        "(\\{\\{ ?[a-z0-9*+ ]{0,8} ?\\}\\}|\\{% ?[a-z ]{0,12} ?%\\}|<\\|[a-z_]{0,12}\\|>|<s>|</s>|\\[MASK\\]|[a-z ]{0,6}){0,12}",
    ]
}

fn any_f32() -> impl Strategy<Value = f32> {
    prop_oneof![
        -2.0f32..2.0,
        Just(f32::NAN),
        Just(f32::INFINITY),
        Just(f32::NEG_INFINITY),
        Just(0.0),
        any::<f32>(),
    ]
}

fn small_or_any_u32() -> impl Strategy<Value = u32> {
    prop_oneof![0u32..40, any::<u32>()]
}

fn opt<T: std::fmt::Debug + Clone>(
    s: impl Strategy<Value = T>,
) -> impl Strategy<Value = Option<T>> {
    proptest::option::of(s)
}

fn any_name() -> impl Strategy<Value = String> {
    prop_oneof![
        Just(String::new()),
        Just("compress-s4".to_owned()),
        Just("latest-m4".to_owned()),
        Just("sequential".to_owned()),
        Just("diagonal".to_owned()),
        Just("aligned".to_owned()),
        Just("upstream".to_owned()),
        Just("random".to_owned()),
        ".{0,12}",
    ]
}

fn any_scheme() -> impl Strategy<Value = Option<pb::generate_request::Scheme>> {
    use pb::generate_request::Scheme;
    let ar = (
        opt(small_or_any_u32()),
        any_name(),
        opt(any_f32()),
        opt(any_f32()),
        any::<bool>(),
        any_name(),
    )
        .prop_map(|(n, c, i, e, cc, x)| {
            Scheme::Ar(pb::ArScheme {
                num_steps: n,
                cache_lookup_strategy: c,
                init_scale: i,
                exit_threshold: e,
                continuous_compute: cc,
                execution: x,
            })
        });
    let df = (
        (
            opt(small_or_any_u32()),
            opt(small_or_any_u32()),
            opt(any_f32()),
            opt(any_f32()),
            opt(any_f32()),
        ),
        (
            opt(small_or_any_u32()),
            opt(small_or_any_u32()),
            opt(any_f32()),
            any_name(),
            any_name(),
        ),
    )
        .prop_map(|((n, r, t, e, s), (h, w, i, c, f))| {
            Scheme::DiffusionForcing(pb::DiffusionForcingScheme {
                num_steps: n,
                inner_recurrence: r,
                exit_t: t,
                ema_embeds: e,
                state_noise_mixing: s,
                headway: h,
                max_wavefront: w,
                init_scale: i,
                cache_lookup_strategy: c,
                freeze_test: f,
                continuous_compute: false,
            })
        });
    let cache = prop_oneof![
        Just(String::new()),
        Just("prefix".to_owned()),
        Just("dual".to_owned()),
        ".{0,12}",
    ];
    let lc = (
        (
            opt(small_or_any_u32()),
            opt(small_or_any_u32()),
            any_name(),
            any_f32(),
        ),
        (
            opt(any_f32()),
            opt(any_f32()),
            cache,
            opt(any_f32()),
            any::<bool>(),
        ),
    )
        .prop_map(|((b, s, r, c), (e, p, kv, t, up))| {
            Scheme::LowConfidence(pb::LowConfidenceScheme {
                block_length: b,
                steps: s,
                remasking: r,
                cfg_scale: c,
                surelock_eps: e,
                surelock_percentile: p,
                kv_cache: kv,
                threshold: t,
                upstream_calls: up,
            })
        });
    let wino = (
        opt(small_or_any_u32()),
        opt(any_f32()),
        opt(any_f32()),
        opt(any_f32()),
        opt(any_f32()),
    )
        .prop_map(|(b, t, tb, e, p)| {
            Scheme::Wino(pb::WinoScheme {
                block_length: b,
                threshold: t,
                threshold_back: tb,
                surelock_eps: e,
                surelock_percentile: p,
            })
        });
    let pi = (
        opt(small_or_any_u32()),
        opt(small_or_any_u32()),
        opt(any_f32()),
        opt(any_f32()),
    )
        .prop_map(|(s, b, st, tt)| {
            Scheme::PlanInfill(pb::PlanInfillScheme {
                slot_size: s,
                serial_num_blocks: b,
                slot_threshold: st,
                token_threshold: tt,
            })
        });
    let alg = prop_oneof![
        Just("entropy".to_owned()),
        Just("origin".to_owned()),
        Just("topk_margin".to_owned()),
        ".{0,12}",
    ];
    let dg = (
        alg,
        opt(small_or_any_u32()),
        opt(any_f32()),
        opt(any_f32()),
        any::<bool>(),
    )
        .prop_map(|(alg, steps, eps, alg_temp, upstream_defaults)| {
            Scheme::DiffusionGenerate(pb::DiffusionGenerateScheme {
                alg,
                steps,
                eps,
                alg_temp,
                upstream_defaults,
            })
        });
    let bd = (
        opt(small_or_any_u32()),
        opt(small_or_any_u32()),
        opt(any_f32()),
        opt(small_or_any_u32()),
        any::<bool>(),
        any::<bool>(),
    )
        .prop_map(|(b, s, t, m, early, upstream)| {
            Scheme::BlockDiffusion(pb::BlockDiffusionScheme {
                block_length: b,
                steps: s,
                threshold: t,
                minimal_topk: m,
                eos_early_stop: early,
                upstream_sampler: upstream,
            })
        });
    let eb = (
        (
            opt(small_or_any_u32()),
            opt(any_f32()),
            opt(any_f32()),
            opt(any_f32()),
        ),
        (
            opt(small_or_any_u32()),
            opt(any_f32()),
            any::<bool>(),
            proptest::collection::vec(prop_oneof![0u32..600, any::<u32>()], 0..20),
            any::<bool>(),
        ),
    )
        .prop_map(|((n, t_max, t_min, bound), (k, c, off, canvas, whole))| {
            Scheme::EntropyBound(pb::EntropyBoundScheme {
                max_denoising_steps: n,
                t_max,
                t_min,
                entropy_bound: bound,
                stability_threshold: k,
                confidence_threshold: c,
                no_early_stop: off,
                initial_canvas: canvas,
                whole_canvases: whole,
            })
        });
    opt(prop_oneof![ar, df, lc, wino, pi, dg, bd, eb])
}

fn any_prompt() -> impl Strategy<Value = Option<pb::generate_request::Prompt>> {
    use pb::generate_request::Prompt;
    opt(prop_oneof![
        any_text().prop_map(Prompt::Text),
        proptest::collection::vec(prop_oneof![0u32..600, any::<u32>()], 0..80)
            .prop_map(|ids| Prompt::TokenIds(pb::TokenIds { ids })),
        proptest::collection::vec(
            (
                prop_oneof![
                    Just("user".to_owned()),
                    Just("assistant".to_owned()),
                    Just("system".to_owned()),
                    ".{0,8}"
                ],
                any_text()
            ),
            0..4
        )
        .prop_map(|m| Prompt::Chat(pb::ChatMessages {
            messages: m
                .into_iter()
                .map(|(role, content)| pb::ChatMessage { role, content })
                .collect(),
        })),
    ])
}

/// Structured outputs of every kind, with arbitrary (mostly invalid) schemas, expressions and
/// grammars.
fn any_structured() -> impl Strategy<Value = Option<pb::StructuredOutput>> {
    use pb::structured_output::Kind;
    opt((
        prop_oneof![
            any_text().prop_map(Kind::Json),
            Just(Kind::Json(
                r#"{"type":"object","properties":{"a":{"type":"integer"}}}"#.into()
            )),
            Just(Kind::JsonObject(true)),
            any_text().prop_map(Kind::Regex),
            Just(Kind::Regex("[0-9]+".into())),
            proptest::collection::vec(any_text(), 0..4)
                .prop_map(|options| Kind::Choice(pb::ChoiceList { options })),
            any_text().prop_map(Kind::Grammar),
        ],
        any::<bool>(),
    )
        .prop_map(|(kind, strict)| pb::StructuredOutput {
            kind: Some(kind),
            strict,
        }))
}

fn any_request() -> impl Strategy<Value = pb::GenerateRequest> {
    (
        any_prompt(),
        prop_oneof![0u32..48, any::<u32>()],
        proptest::collection::vec(any::<u32>(), 0..20),
        proptest::collection::vec(any_text(), 0..20),
        opt((any_f32(), small_or_any_u32(), any_f32(), opt(any::<u64>()))),
        (
            any::<bool>(),
            opt(any::<bool>()),
            opt(small_or_any_u32()),
            opt(small_or_any_u32()),
            any_structured(),
        ),
        any_scheme(),
    )
        .prop_map(
            |(
                prompt,
                max_new_tokens,
                stop_ids,
                stops,
                sampling,
                (canvas, skip, logprobs, prompt_logprobs, structured_output),
                scheme,
            )| {
                pb::GenerateRequest {
                    n: None,
                    prompt_logprobs,
                    structured_output,
                    likelihood: None,
                    model: String::new(),
                    prompt,
                    max_new_tokens,
                    stop_token_ids: stop_ids,
                    stop_strings: stops,
                    sampling: sampling.map(|(temperature, top_k, top_p, seed)| {
                        pb::SamplingParams {
                            temperature,
                            top_k,
                            top_p,
                            seed,
                        }
                    }),
                    stream_canvas: canvas,
                    skip_special_tokens: skip,
                    scheme,
                    logprobs,
                }
            },
        )
}

fn cases(default: u32) -> ProptestConfig {
    // PROPTEST_CASES (the standard variable) overrides the CI budget.
    let cases = std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default);
    ProptestConfig {
        cases,
        failure_persistence: None,
        ..ProptestConfig::default()
    }
}

/// Runs `test` over `strategy` on a thread with a large stack: proptest's nested strategies
/// recurse deeply in debug builds (the code under test still runs on 2 MiB, in `serve`).
fn run_deep<S: Strategy + Send + 'static>(
    strategy: S,
    test: impl Fn(S::Value) -> Result<(), TestCaseError> + Send + 'static,
) where
    S::Value: std::fmt::Debug,
{
    std::thread::Builder::new()
        .stack_size(256 << 20)
        .spawn(move || {
            let mut runner = proptest::test_runner::TestRunner::new(cases(256));
            if let Err(e) = runner.run(&strategy, test) {
                panic!("{e}");
            }
        })
        .expect("thread")
        .join()
        .expect("the property holds");
}

/// Arbitrary field values, on every family.
#[test]
fn any_request_is_admitted_or_refused_with_a_documented_status() {
    run_deep((any_request(), 0..FAMILIES.len()), |(req, family)| {
        check_outcome(serve(&req, models()[family].as_ref()))
    });
}

/// Arbitrary bytes on the wire: a decoding failure (the server answers INVALID_ARGUMENT for it,
/// `wavefront_proto::codec`) or a request that goes through the same path.
#[test]
fn any_bytes_decode_or_fail_cleanly() {
    run_deep(
        (
            proptest::collection::vec(any::<u8>(), 0..256),
            0..FAMILIES.len(),
        ),
        |(bytes, family)| match pb::GenerateRequest::decode(bytes.as_slice()) {
            Ok(req) => check_outcome(serve(&req, models()[family].as_ref())),
            Err(_) => Ok(()),
        },
    );
}

proptest! {
    #![proptest_config(cases(256))]

    /// A message is data: template syntax in it is rendered verbatim.
    #[test]
    fn template_syntax_in_a_message_is_rendered_verbatim(
        content in "(\\{\\{ ?7 ?\\* ?7 ?\\}\\}|\\{% ?(raw|endraw|if true|endif|for x in range\\(3\\)|endfor|set x = 1) ?%\\}|\\{#|#\\}|[a-z ]{0,6}){1,10}",
    ) {
        for model in models() {
            let Some(tok) = model.tokenizer() else { continue };
            let Some(template) = tok.chat_template() else { continue };
            let messages = [wavefront_models::ChatMessage::new("user", content.as_str())];
            // Templates may trim a message (Llama 3's does): the rest is kept as it is.
            match template.render(&messages, true) {
                Ok(text) => prop_assert!(
                    text.contains(content.trim()),
                    "{}: the message was not rendered verbatim: {:?}",
                    model.info().name,
                    text
                ),
                Err(e) => prop_assert!(false, "{}: rendering failed: {e}", model.info().name),
            }
        }
    }

    /// Any text tokenizes without panicking, and the worker's cheap bound never exceeds the
    /// real token count.
    #[test]
    fn the_pre_tokenizing_bound_never_exceeds_the_token_count(text in any_text()) {
        for model in models() {
            let Some(tok) = model.tokenizer() else { continue };
            if let Ok(ids) = tok.encode(&text, false) {
                prop_assert!(
                    tok.min_tokens(&text) <= ids.len(),
                    "{}: bound {} above {} tokens for {:?}",
                    model.info().name,
                    tok.min_tokens(&text),
                    ids.len(),
                    text
                );
            }
        }
    }
}

/// Very long inputs: refused by the size checks before tokenizing, quickly.
#[test]
fn a_very_long_prompt_is_refused_before_tokenizing() {
    let text = "word ".repeat(2_000_000); // 10 MB
    for model in models() {
        if model.tokenizer().is_none() {
            continue;
        }
        let req = pb::GenerateRequest {
            prompt: Some(pb::generate_request::Prompt::Text(text.clone())),
            max_new_tokens: 4,
            ..Default::default()
        };
        let start = std::time::Instant::now();
        let err = serve(&req, model.as_ref()).expect_err("too long");
        assert_eq!(err.code(), Code::InvalidArgument, "{err:?}");
        assert!(
            start.elapsed() < std::time::Duration::from_secs(1),
            "{}: took {:?}",
            model.info().name,
            start.elapsed()
        );
    }
}

/// A chat whose template alone makes it longer than the context (many empty messages, under
/// `--max-chat-messages`) is refused by the field checks, before the request is converted or
/// rendered; the bound the models publish for routers (`chat_overhead`) is what refuses it.
#[test]
fn a_chat_too_long_for_the_context_is_refused_before_it_is_converted() {
    let limits = RequestLimits::default();
    let mut checked = 0;
    for model in models() {
        let (fixed, per_message) = model.chat_overhead();
        if per_message == 0 {
            continue;
        }
        let context = model.info().max_context;
        let n = (context - fixed.min(context)) / per_message + 1;
        if n > limits.max_chat_messages {
            continue;
        }
        let req = pb::GenerateRequest {
            prompt: Some(pb::generate_request::Prompt::Chat(pb::ChatMessages {
                messages: vec![
                    pb::ChatMessage {
                        role: "user".into(),
                        content: String::new(),
                    };
                    n
                ],
            })),
            max_new_tokens: 4,
            ..Default::default()
        };
        let err = limits
            .check_fields(&req, model.as_ref())
            .expect_err("too long");
        assert_eq!(err.code(), Code::InvalidArgument, "{err:?}");
        assert!(
            err.message()
                .contains(&format!("at least {} tokens", fixed + n * per_message)),
            "{}",
            err.message()
        );
        // One message fewer fits the bound (whatever the rendering then says).
        let mut fewer = req.clone();
        if let Some(pb::generate_request::Prompt::Chat(c)) = &mut fewer.prompt {
            c.messages.pop();
        }
        assert!(limits.check_fields(&fewer, model.as_ref()).is_ok());
        checked += 1;
    }
    assert!(checked > 0, "no embedded model has a chat template");
}

/// The model's own refusal of a chat too long for its context (the offline path's) says what
/// the worker's and the router's say.
#[test]
fn the_models_and_the_servers_refusals_of_a_long_chat_read_the_same() {
    assert_eq!(
        wavefront_schemes::chat_too_long(1024, 7170, 4096),
        wavefront_proto::limits::chat_too_long(1024, 7170, 4096)
    );
}
