//! Protobuf <-> domain conversions (the only place both kinds of type meet).

use crate::status::from_request_error;
use std::sync::Arc;
use std::time::Instant;

use tonic::Status;
use wavefront_engine::{CanvasFrame, CellState, FinishReason, Stats, TokenLogprob};
use wavefront_models::ChatMessage;
use wavefront_proto::v1 as pb;
use wavefront_schemes::constraint::Constraint;
use wavefront_schemes::{
    ArParams, BlockDiffusionParams, DiffusionForcingParams, DiffusionGenerateParams,
    EntropyBoundParams, FreezeTest, GenerateSpec, KvCacheMode, LowConfidenceParams,
    PlanInfillParams, Remasking, ReplayDraws, SamplingParams, SchemeParams, ServedModel,
    SureLockParams, WinoParams,
};

/// Turns a public request into a spec for `model`: tokenizes text prompts
/// and fills scheme defaults. Range checks happen in the family's planner.
pub fn spec_from_proto(
    req: &pb::GenerateRequest,
    model: &dyn ServedModel,
) -> Result<GenerateSpec, Status> {
    let prompt_ids = match &req.prompt {
        None => {
            return Err(Status::invalid_argument(
                "prompt is missing: set `text`, `token_ids` or `chat`",
            ))
        }
        Some(pb::generate_request::Prompt::Text(t)) => {
            if t.is_empty() {
                return Err(Status::invalid_argument("prompt text is empty"));
            }
            model
                .encode_prompt(t)
                .map_err(|e| Status::invalid_argument(format!("cannot tokenize prompt: {e}")))?
        }
        Some(pb::generate_request::Prompt::TokenIds(ids)) => ids.ids.clone(),
        Some(pb::generate_request::Prompt::Chat(chat)) => {
            if chat.messages.is_empty() {
                return Err(Status::invalid_argument("chat has no messages"));
            }
            let messages: Vec<ChatMessage> = chat
                .messages
                .iter()
                .map(|m| ChatMessage::new(&m.role, &m.content))
                .collect();
            model.encode_chat(&messages).map_err(|e| {
                Status::invalid_argument(format!("cannot format the chat prompt: {e}"))
            })?
        }
    };
    let sampling = req.sampling.unwrap_or_default();
    let seed = sampling.seed.unwrap_or_else(random_seed);
    let sampling = SamplingParams {
        temperature: sampling.temperature,
        top_k: sampling.top_k as usize,
        top_p: if sampling.top_p == 0.0 {
            1.0
        } else {
            sampling.top_p
        },
        seed,
        logprobs: req.logprobs.map(|n| n as usize),
        prompt_logprobs: req.prompt_logprobs.map(|n| n as usize),
        likelihood_context: req
            .likelihood
            .as_ref()
            .and_then(|l| l.context_tokens)
            .map(|n| n as usize),
        mc_samples: req
            .likelihood
            .as_ref()
            .and_then(|l| l.mc_samples)
            .map(|n| n as usize),
    };
    let scheme = match &req.scheme {
        None => default_scheme(model),
        Some(pb::generate_request::Scheme::Ar(a)) => SchemeParams::Ar(ArParams {
            num_steps: a.num_steps.map(|n| n as usize),
            cache_lookup_strategy: non_empty(&a.cache_lookup_strategy),
            init_scale: a.init_scale,
            exit_threshold: a.exit_threshold,
            continuous_compute: a.continuous_compute,
            execution: a.execution.parse().map_err(|e| from_request_error(&e))?,
        }),
        Some(pb::generate_request::Scheme::DiffusionForcing(d)) => {
            let def = DiffusionForcingParams::default();
            SchemeParams::DiffusionForcing(DiffusionForcingParams {
                num_steps: d.num_steps.map(|n| n as usize),
                inner_recurrence: d.inner_recurrence.map_or(def.inner_recurrence, |n| n as usize),
                exit_t: d.exit_t.unwrap_or(def.exit_t),
                ema_embeds: d.ema_embeds.unwrap_or(def.ema_embeds),
                state_noise_mixing: d.state_noise_mixing.unwrap_or(def.state_noise_mixing),
                headway: d.headway.map_or(def.headway, |n| n as usize),
                max_wavefront: d.max_wavefront.map_or(def.max_wavefront, |n| n as usize),
                init_scale: d.init_scale.unwrap_or(def.init_scale),
                cache_lookup_strategy: non_empty(&d.cache_lookup_strategy).unwrap_or(def.cache_lookup_strategy),
                freeze_test: match d.freeze_test.as_str() {
                    "" | "aligned" => FreezeTest::Aligned,
                    "upstream" => FreezeTest::Upstream,
                    other => {
                        return Err(Status::invalid_argument(format!(
                            "diffusion_forcing.freeze_test must be `aligned` or `upstream`, got {other:?}"
                        )))
                    }
                },
                continuous_compute: d.continuous_compute,
            })
        }
        Some(pb::generate_request::Scheme::LowConfidence(l)) => {
            SchemeParams::LowConfidence(LowConfidenceParams {
                block_length: l.block_length.map(|n| n as usize),
                steps: l.steps.map(|n| n as usize),
                remasking: match l.remasking.as_str() {
                    "" | "low_confidence" => Remasking::LowConfidence,
                    "random" => Remasking::Random,
                    other => {
                        return Err(Status::invalid_argument(format!(
                            "low_confidence.remasking must be `low_confidence` or `random`, got {other:?}"
                        )))
                    }
                },
                cfg_scale: l.cfg_scale,
                surelock: surelock("low_confidence", l.surelock_eps, l.surelock_percentile)?,
                kv_cache: match l.kv_cache.as_str() {
                    "" | "none" => KvCacheMode::None,
                    "prefix" => KvCacheMode::Prefix,
                    "dual" => KvCacheMode::Dual,
                    other => {
                        return Err(Status::invalid_argument(format!(
                            "low_confidence.kv_cache must be `none`, `prefix` or `dual`, got {other:?}"
                        )))
                    }
                },
                threshold: l.threshold,
                upstream_calls: l.upstream_calls,
            })
        }
        Some(pb::generate_request::Scheme::Wino(w)) => {
            let def = WinoParams::default();
            SchemeParams::Wino(WinoParams {
                block_length: w.block_length.map(|n| n as usize),
                threshold: w.threshold.unwrap_or(def.threshold),
                threshold_back: w.threshold_back.unwrap_or(def.threshold_back),
                surelock: surelock("wino", w.surelock_eps, w.surelock_percentile)?,
            })
        }
        Some(pb::generate_request::Scheme::PlanInfill(p)) => {
            let def = PlanInfillParams::default();
            SchemeParams::PlanInfill(PlanInfillParams {
                span_size: p.slot_size.map_or(def.span_size, |n| n as usize),
                serial_num_blocks: p
                    .serial_num_blocks
                    .map_or(def.serial_num_blocks, |n| n as usize),
                span_threshold: p.slot_threshold.unwrap_or(def.span_threshold),
                token_threshold: p.token_threshold.unwrap_or(def.token_threshold),
                ..def
            })
        }
        Some(pb::generate_request::Scheme::DiffusionGenerate(d)) => {
            let def = DiffusionGenerateParams::default();
            SchemeParams::DiffusionGenerate(DiffusionGenerateParams {
                alg: d.alg.parse().map_err(|e| from_request_error(&e))?,
                steps: d.steps.map(|n| n as usize),
                eps: d.eps.unwrap_or(def.eps),
                alg_temp: d.alg_temp.unwrap_or(def.alg_temp),
                upstream_defaults: d.upstream_defaults,
            })
        }
        Some(pb::generate_request::Scheme::BlockDiffusion(b)) => {
            let def = BlockDiffusionParams::default();
            SchemeParams::BlockDiffusion(BlockDiffusionParams {
                block_length: b.block_length.map_or(def.block_length, |n| n as usize),
                steps: b.steps.map_or(def.steps, |n| n as usize),
                threshold: b.threshold.unwrap_or(def.threshold),
                minimal_topk: b.minimal_topk.map_or(def.minimal_topk, |n| n as usize),
                eos_early_stop: b.eos_early_stop,
                upstream_sampler: b.upstream_sampler,
            })
        }
        Some(pb::generate_request::Scheme::EntropyBound(e)) => {
            SchemeParams::EntropyBound(EntropyBoundParams {
                max_denoising_steps: e.max_denoising_steps.map(|n| n as usize),
                t_max: e.t_max,
                t_min: e.t_min,
                entropy_bound: e.entropy_bound,
                stability_threshold: e.stability_threshold.map(|n| n as usize),
                confidence_threshold: e.confidence_threshold,
                no_early_stop: e.no_early_stop,
                initial_canvas: e.initial_canvas.clone(),
                whole_canvases: e.whole_canvases,
            })
        }
    };
    let guide = match &req.structured_output {
        None => None,
        Some(so) => {
            let c = constraint(so)?;
            Some(model.guide(&c).map_err(|e| {
                Status::invalid_argument(format!(
                    "structured_output.{} cannot constrain this model's output: {e}",
                    c.name()
                ))
            })?)
        }
    };
    Ok(GenerateSpec {
        guide,
        prompt_ids,
        max_new_tokens: req.max_new_tokens as usize,
        stop_token_ids: req.stop_token_ids.clone(),
        sampling,
        scheme,
        replay_draws: None::<Arc<ReplayDraws>>,
        stream_canvas: req.stream_canvas,
    })
}

/// A canvas frame as the API's event.
pub fn canvas_event(f: &CanvasFrame) -> pb::CanvasEvent {
    pb::CanvasEvent {
        index: 0,
        step: f.step,
        full: f.full,
        positions: f.positions.clone(),
        token_ids: f.tokens.clone(),
        states: f
            .states
            .iter()
            .map(|s| {
                (match s {
                    CellState::Masked => pb::CellState::Masked,
                    CellState::Drafted => pb::CellState::Drafted,
                    CellState::Committed => pb::CellState::Committed,
                    CellState::Locked => pb::CellState::Locked,
                }) as i32
            })
            .collect(),
    }
}

/// The scheme of a request that names none: `plan-infill`, `diffusion-generate`,
/// `block-diffusion` or `entropy-bound` for a model that lists it first (slot diffusion, Dream,
/// LLaDA2.0, DiffusionGemma), else `ar` where the model serves it, otherwise
/// the model's first scheme with its defaults.
fn default_scheme(model: &dyn ServedModel) -> SchemeParams {
    let schemes = &model.info().schemes;
    if schemes.first() == Some(&"plan-infill") {
        return SchemeParams::PlanInfill(PlanInfillParams::default());
    }
    if schemes.first() == Some(&"diffusion-generate") {
        return SchemeParams::DiffusionGenerate(DiffusionGenerateParams::default());
    }
    if schemes.first() == Some(&"block-diffusion") {
        return SchemeParams::BlockDiffusion(BlockDiffusionParams::default());
    }
    if schemes.first() == Some(&"entropy-bound") {
        return SchemeParams::EntropyBound(EntropyBoundParams::default());
    }
    if !schemes.contains(&"ar") && schemes.first() == Some(&"low-confidence") {
        SchemeParams::LowConfidence(LowConfidenceParams::default())
    } else {
        SchemeParams::Ar(ArParams::default())
    }
}

/// SureLock's parameters; the gate needs `surelock_eps`.
fn surelock(
    scheme: &str,
    eps: Option<f32>,
    percentile: Option<f32>,
) -> Result<Option<SureLockParams>, Status> {
    match (eps, percentile) {
        (None, None) => Ok(None),
        (None, Some(_)) => Err(Status::invalid_argument(format!(
            "{scheme}.surelock_percentile needs {scheme}.surelock_eps (SureLock is off without it)"
        ))),
        (Some(eps), percentile) => Ok(Some(SureLockParams { eps, percentile })),
    }
}

fn non_empty(s: &str) -> Option<String> {
    (!s.is_empty()).then(|| s.to_owned())
}

fn random_seed() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos()),
    );
    h.finish()
}

pub fn finish_reason(r: FinishReason) -> pb::FinishReason {
    match r {
        FinishReason::Length => pb::FinishReason::Length,
        FinishReason::StopToken => pb::FinishReason::StopToken,
        FinishReason::StopString => pb::FinishReason::StopString,
        FinishReason::ContextLimit => pb::FinishReason::ContextLimit,
    }
}

pub fn stats(s: &Stats, seed: u64) -> pb::GenerationStats {
    pb::GenerationStats {
        prompt_tokens: s.prompt_tokens,
        generated_tokens: s.generated_tokens,
        forward_passes: s.forward_passes,
        recurrence_steps: s.recurrence_steps,
        ticks: s.ticks,
        queue_time_ms: s.queue_time.as_secs_f64() * 1e3,
        compute_time_ms: s.compute_time.as_secs_f64() * 1e3,
        tokens_per_second: s.tokens_per_second(),
        seed,
        counters: s.counters.clone().into_iter().collect(),
        series: s
            .series
            .iter()
            .map(|(k, v)| (k.clone(), pb::UintList { values: v.clone() }))
            .collect(),
        migrations: s.migrations,
    }
}

pub fn model_info(model: &dyn ServedModel) -> pb::ModelInfo {
    let i = model.info();
    let (fixed, per_message) = model.chat_overhead();
    pb::ModelInfo {
        name: i.name.clone(),
        family: i.family.to_owned(),
        schemes: i.schemes.iter().map(|s| (*s).to_owned()).collect(),
        vocab_size: i.vocab_size as u32,
        max_context: i.max_context as u32,
        chat_tokens_fixed: u32::try_from(fixed).unwrap_or(u32::MAX),
        chat_tokens_per_message: u32::try_from(per_message).unwrap_or(u32::MAX),
    }
}

/// The deadline the client set with the standard `grpc-timeout` header.
pub fn deadline_from_metadata(
    md: &tonic::metadata::MetadataMap,
) -> Result<Option<Instant>, Status> {
    wavefront_proto::timeout::deadline(md).map_err(Status::invalid_argument)
}

#[cfg(test)]
mod masked_diffusion_tests {
    use super::*;
    use wavefront_schemes::{load_model, LoadOptions};

    fn llada() -> Arc<dyn ServedModel> {
        let dir = wavefront_models::device::test_fixture("llada");
        let files = wavefront_models::ModelFiles::from_dir(dir).expect("fixture");
        load_model(files, LoadOptions::default()).expect("loads")
    }

    fn request(scheme: Option<pb::generate_request::Scheme>) -> pb::GenerateRequest {
        pb::GenerateRequest {
            prompt: Some(pb::generate_request::Prompt::TokenIds(pb::TokenIds {
                ids: vec![448, 47, 355],
            })),
            max_new_tokens: 16,
            scheme,
            ..Default::default()
        }
    }

    #[test]
    fn masked_diffusion_schemes_convert_with_upstream_names_and_defaults() {
        let model = llada();
        let lc = pb::LowConfidenceScheme {
            block_length: Some(8),
            steps: Some(16),
            remasking: "random".into(),
            cfg_scale: 0.5,
            surelock_eps: Some(1e-3),
            surelock_percentile: Some(20.0),
            kv_cache: String::new(),
            threshold: None,
            upstream_calls: false,
        };
        let spec = spec_from_proto(
            &request(Some(pb::generate_request::Scheme::LowConfidence(lc))),
            model.as_ref(),
        )
        .expect("converts");
        assert_eq!(
            spec.scheme,
            SchemeParams::LowConfidence(LowConfidenceParams {
                block_length: Some(8),
                steps: Some(16),
                remasking: Remasking::Random,
                cfg_scale: 0.5,
                surelock: Some(SureLockParams {
                    eps: 1e-3,
                    percentile: Some(20.0)
                }),
                kv_cache: KvCacheMode::None,
                threshold: None,
                upstream_calls: false,
            })
        );
        // Fast-dLLM's options keep upstream's names; an unknown cache mode is refused.
        let fast = pb::LowConfidenceScheme {
            kv_cache: "dual".into(),
            threshold: Some(0.9),
            upstream_calls: true,
            ..Default::default()
        };
        let spec = spec_from_proto(
            &request(Some(pb::generate_request::Scheme::LowConfidence(fast))),
            model.as_ref(),
        )
        .expect("converts");
        assert!(matches!(
            spec.scheme,
            SchemeParams::LowConfidence(LowConfidenceParams {
                kv_cache: KvCacheMode::Dual,
                threshold: Some(t),
                upstream_calls: true,
                ..
            }) if t == 0.9
        ));
        let bad = pb::LowConfidenceScheme {
            kv_cache: "suffix".into(),
            ..Default::default()
        };
        let err = spec_from_proto(
            &request(Some(pb::generate_request::Scheme::LowConfidence(bad))),
            model.as_ref(),
        )
        .expect_err("refused");
        assert!(
            err.message()
                .contains("kv_cache must be `none`, `prefix` or `dual`"),
            "{}",
            err.message()
        );
        let wino = pb::WinoScheme {
            block_length: Some(8),
            threshold: None,
            threshold_back: Some(0.95),
            ..Default::default()
        };
        let spec = spec_from_proto(
            &request(Some(pb::generate_request::Scheme::Wino(wino))),
            model.as_ref(),
        )
        .expect("converts");
        assert_eq!(
            spec.scheme,
            SchemeParams::Wino(WinoParams {
                block_length: Some(8),
                threshold: 0.6,
                threshold_back: 0.95,
                surelock: None,
            })
        );
        // No scheme: the masked-diffusion model's default sampler.
        let spec = spec_from_proto(&request(None), model.as_ref()).expect("converts");
        assert_eq!(
            spec.scheme,
            SchemeParams::LowConfidence(LowConfidenceParams::default())
        );
        model.shutdown();
    }

    #[test]
    fn bad_masked_diffusion_options_are_invalid_arguments() {
        let model = llada();
        let bad = [
            pb::generate_request::Scheme::LowConfidence(pb::LowConfidenceScheme {
                remasking: "lowest".into(),
                ..Default::default()
            }),
            pb::generate_request::Scheme::Wino(pb::WinoScheme {
                surelock_percentile: Some(20.0),
                ..Default::default()
            }),
        ];
        for scheme in bad {
            let err = spec_from_proto(&request(Some(scheme)), model.as_ref()).unwrap_err();
            assert_eq!(err.code(), tonic::Code::InvalidArgument, "{err:?}");
        }
        model.shutdown();
    }
}

#[cfg(test)]
mod recurrent_memory_tests {
    use super::*;
    use wavefront_schemes::{load_model, Execution, LoadOptions};

    fn armt() -> Arc<dyn ServedModel> {
        let dir = wavefront_models::device::test_fixture("armt");
        let files = wavefront_models::ModelFiles::from_dir(dir).expect("fixture");
        load_model(files, LoadOptions::default()).expect("loads")
    }

    fn request(execution: &str) -> pb::GenerateRequest {
        pb::GenerateRequest {
            prompt: Some(pb::generate_request::Prompt::TokenIds(pb::TokenIds {
                ids: (1..40).collect(),
            })),
            max_new_tokens: 4,
            scheme: Some(pb::generate_request::Scheme::Ar(pb::ArScheme {
                execution: execution.into(),
                ..Default::default()
            })),
            ..Default::default()
        }
    }

    #[test]
    fn the_execution_mode_converts_and_an_unknown_one_is_an_invalid_argument() {
        let model = armt();
        assert_eq!(model.info().family, "recurrent_memory");
        for (name, want) in [
            ("", Execution::Auto),
            ("auto", Execution::Auto),
            ("sequential", Execution::Sequential),
            ("diagonal", Execution::Diagonal),
        ] {
            let spec = spec_from_proto(&request(name), model.as_ref()).expect("converts");
            let SchemeParams::Ar(a) = spec.scheme else {
                panic!("{name}: not ar");
            };
            assert_eq!(a.execution, want);
        }
        let err = spec_from_proto(&request("pipelined"), model.as_ref()).unwrap_err();
        assert_eq!(err.code(), tonic::Code::InvalidArgument);
        assert!(err.message().contains("sequential"), "{err:?}");
        // No scheme: ar with automatic execution.
        let mut req = request("");
        req.scheme = None;
        let spec = spec_from_proto(&req, model.as_ref()).expect("converts");
        assert_eq!(spec.scheme, SchemeParams::Ar(ArParams::default()));
        model.shutdown();
    }
}

#[cfg(test)]
mod slot_diffusion_tests {
    use super::*;
    use wavefront_schemes::{load_model, LoadOptions};

    fn refusion() -> Arc<dyn ServedModel> {
        let dir = wavefront_models::device::test_fixture("refusion");
        let files = wavefront_models::ModelFiles::from_dir(dir).expect("fixture");
        load_model(files, LoadOptions::default()).expect("loads")
    }

    fn request(scheme: Option<pb::generate_request::Scheme>) -> pb::GenerateRequest {
        pb::GenerateRequest {
            prompt: Some(pb::generate_request::Prompt::TokenIds(pb::TokenIds {
                ids: vec![34, 78, 79],
            })),
            max_new_tokens: 32,
            scheme,
            ..Default::default()
        }
    }

    #[test]
    fn plan_infill_converts_with_upstream_names_and_defaults() {
        let model = refusion();
        assert_eq!(model.info().schemes, vec!["plan-infill", "ar"]);
        let p = pb::PlanInfillScheme {
            slot_size: Some(4),
            serial_num_blocks: None,
            slot_threshold: Some(0.8),
            token_threshold: Some(0.2),
        };
        let spec = spec_from_proto(
            &request(Some(pb::generate_request::Scheme::PlanInfill(p))),
            model.as_ref(),
        )
        .expect("converts");
        assert_eq!(
            spec.scheme,
            SchemeParams::PlanInfill(PlanInfillParams {
                span_size: 4,
                serial_num_blocks: 2,
                span_threshold: 0.8,
                token_threshold: 0.2,
                ..PlanInfillParams::default()
            })
        );
        // No scheme: the slot-diffusion model's default is plan-infill with upstream defaults.
        let spec = spec_from_proto(&request(None), model.as_ref()).expect("converts");
        assert_eq!(
            spec.scheme,
            SchemeParams::PlanInfill(PlanInfillParams::default())
        );
        model.shutdown();
    }

    #[test]
    fn diffusion_generate_converts_with_upstream_names_and_defaults() {
        use wavefront_schemes::{DiffusionGenerateParams, DreamAlg};
        let dir = wavefront_models::device::test_fixture("dream");
        let files = wavefront_models::ModelFiles::from_dir(dir).expect("fixture");
        let model = load_model(files, LoadOptions::default()).expect("loads");
        assert_eq!(
            model.info().schemes,
            vec!["diffusion-generate", "low-confidence"]
        );
        let d = pb::DiffusionGenerateScheme {
            alg: "topk_margin".into(),
            steps: Some(8),
            eps: None,
            alg_temp: Some(0.25),
            upstream_defaults: true,
        };
        let spec = spec_from_proto(
            &request(Some(pb::generate_request::Scheme::DiffusionGenerate(d))),
            model.as_ref(),
        )
        .expect("converts");
        assert_eq!(
            spec.scheme,
            SchemeParams::DiffusionGenerate(DiffusionGenerateParams {
                alg: DreamAlg::TopkMargin,
                steps: Some(8),
                eps: 1e-3,
                alg_temp: 0.25,
                upstream_defaults: true,
            })
        );
        // No scheme: Dream's default is its own sampler, with the entropy rule.
        let spec = spec_from_proto(&request(None), model.as_ref()).expect("converts");
        assert_eq!(
            spec.scheme,
            SchemeParams::DiffusionGenerate(DiffusionGenerateParams::default())
        );
        let bad = pb::DiffusionGenerateScheme {
            alg: "greedy".into(),
            ..Default::default()
        };
        let err = spec_from_proto(
            &request(Some(pb::generate_request::Scheme::DiffusionGenerate(bad))),
            model.as_ref(),
        )
        .unwrap_err();
        assert_eq!(err.code(), tonic::Code::InvalidArgument);
        assert!(err.message().contains("diffusion_generate.alg"), "{err}");
        model.shutdown();
    }

    #[test]
    fn block_diffusion_converts_with_upstream_names_and_defaults() {
        use wavefront_schemes::BlockDiffusionParams;
        let dir = wavefront_models::device::test_fixture("llada2");
        let files = wavefront_models::ModelFiles::from_dir(dir).expect("fixture");
        let model = load_model(files, LoadOptions::default()).expect("loads");
        assert_eq!(model.info().schemes, vec!["block-diffusion"]);
        let b = pb::BlockDiffusionScheme {
            block_length: Some(8),
            steps: None,
            threshold: Some(0.7),
            minimal_topk: None,
            eos_early_stop: true,
            upstream_sampler: false,
        };
        let spec = spec_from_proto(
            &request(Some(pb::generate_request::Scheme::BlockDiffusion(b))),
            model.as_ref(),
        )
        .expect("converts");
        assert_eq!(
            spec.scheme,
            SchemeParams::BlockDiffusion(BlockDiffusionParams {
                block_length: 8,
                threshold: 0.7,
                eos_early_stop: true,
                ..BlockDiffusionParams::default()
            })
        );
        // No scheme: LLaDA2.0's default is block diffusion with upstream's defaults.
        let spec = spec_from_proto(&request(None), model.as_ref()).expect("converts");
        assert_eq!(
            spec.scheme,
            SchemeParams::BlockDiffusion(BlockDiffusionParams::default())
        );
        model.shutdown();
    }
}

/// The protobuf log-probabilities of `ids`, each token's text alone (special tokens included).
pub fn logprobs(
    model: &dyn ServedModel,
    ids: &[u32],
    scored: &[TokenLogprob],
) -> Vec<pb::TokenLogprob> {
    let text = |id: u32| model.decode_text(&[id], false);
    ids.iter()
        .zip(scored)
        .map(|(&token_id, lp)| pb::TokenLogprob {
            token_id,
            logprob: lp.logprob,
            token: text(token_id),
            top_logprobs: lp
                .top
                .iter()
                .map(|&(token_id, logprob)| pb::TopLogprob {
                    token_id,
                    logprob,
                    token: text(token_id),
                })
                .collect(),
        })
        .collect()
}

/// A request's structured output as the schemes' constraint.
fn constraint(so: &pb::StructuredOutput) -> Result<Constraint, Status> {
    use pb::structured_output::Kind;
    let bad = |m: String| Err(Status::invalid_argument(m));
    Ok(match &so.kind {
        None => {
            return bad(
                "structured_output sets none of json, json_object, regex, choice, grammar".into(),
            )
        }
        Some(Kind::Json(text)) => match serde_json::from_str::<serde_json::Value>(text) {
            Ok(schema) if schema.is_object() => Constraint::JsonSchema {
                schema,
                strict: so.strict,
            },
            Ok(_) => return bad("structured_output.json must be a JSON schema object".into()),
            Err(e) => return bad(format!("structured_output.json is not valid JSON: {e}")),
        },
        Some(Kind::JsonObject(_)) => Constraint::JsonObject,
        Some(Kind::Regex(r)) => Constraint::Regex(r.clone()),
        Some(Kind::Choice(c)) => Constraint::Choice(c.options.clone()),
        Some(Kind::Grammar(g)) => Constraint::Grammar(g.clone()),
    })
}
