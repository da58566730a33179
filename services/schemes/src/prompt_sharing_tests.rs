//! Prompt sharing behind the real engine thread ([`wavefront_engine::Family::adopt_prompt`]):
//! requests with the same prompt, submitted together (the choices of a request with `n` > 1,
//! seeded apart), read the first one's prompt pages instead of computing them, and each still
//! decodes what it decodes alone; requests with other prompts share nothing; every slot comes
//! back, shared ones included.

use anyhow::{ensure, Result};
use std::time::Duration;

use crate::request::{ArParams, GenerateSpec, SchemeParams};
use crate::test_support::{collect, submit, wait_for_free_slots, Outcome};
use crate::{load_model, LoadOptions};
use wavefront_models::ModelFiles;

fn no_prefix_cache(name: &str, max_active: usize) -> LoadOptions {
    LoadOptions {
        name: name.into(),
        max_active,
        prefix_cache_entries: 0,
        ..LoadOptions::default()
    }
}

/// Serves every request alone with the prefix cache off, then one after another (each
/// submitted once the one before has finished) with it on: each decodes the same tokens both
/// times; returns the rows each read from a finished request's pages the second time.
fn after_one_another(
    files: impl Fn() -> Result<ModelFiles>,
    name: &str,
    specs: &[GenerateSpec],
) -> Result<Vec<u64>> {
    let alone = {
        let served = load_model(files()?, no_prefix_cache(name, 1))?;
        let out = specs
            .iter()
            .map(|s| collect(&submit(served.as_ref(), s.clone())?, Vec::new()))
            .collect::<Result<Vec<_>>>()?;
        served.shutdown();
        out
    };
    let opts = LoadOptions {
        name: name.into(),
        ..LoadOptions::default()
    };
    let served = load_model(files()?, opts)?;
    let mut shared = Vec::new();
    for (i, (s, a)) in specs.iter().zip(&alone).enumerate() {
        let t = collect(&submit(served.as_ref(), s.clone())?, Vec::new())?;
        ensure!(
            (&a.tokens, a.reason) == (&t.tokens, t.reason),
            "request {i}: after the others {:?} {:?}, alone {:?} {:?}",
            t.tokens,
            t.reason,
            a.tokens,
            a.reason
        );
        shared.push(shared_rows(&t));
    }
    // The cache's slots count as free.
    wait_for_free_slots(served.as_ref(), Duration::from_secs(30))?;
    served.shutdown();
    Ok(shared)
}

/// The prefix cache: a request whose prompt a finished request computed reads that request's
/// pages (ReFusion `ar` and plan-and-infill alike, greedy and sampled) and decodes what it
/// decodes alone; another prompt shares nothing, and the first prompt's entry is still there
/// after it.
#[test]
fn refusion_requests_read_a_finished_requests_prompt_pages() -> Result<()> {
    use crate::slot_diffusion::test_support::{fixture_files, prompt};
    let p = prompt(40, 3);
    let ar = || SchemeParams::Ar(ArParams::default());
    let pi = || SchemeParams::PlanInfill(crate::request::PlanInfillParams::default());
    let mut sampled = GenerateSpec::greedy(p.clone(), 8, 1, ar());
    sampled.sampling.temperature = 0.9;
    let specs = vec![
        GenerateSpec::greedy(p.clone(), 8, 0, ar()),
        sampled,
        GenerateSpec::greedy(p.clone(), 16, 0, pi()),
        GenerateSpec::greedy(prompt(40, 4), 8, 0, ar()),
        GenerateSpec::greedy(p.clone(), 8, 0, ar()),
    ];
    let shared = after_one_another(fixture_files, "refusion", &specs)?;
    assert_eq!(shared, [0, 32, 32, 0, 32]);
    Ok(())
}

/// Prompts that only begin alike: an `ar` request reads the whole pages of its prompt's longest
/// common prefix with a kept one's (40 common tokens of 48: two pages), and decodes what it
/// decodes alone; a plan-and-infill request reads only a whole prompt's (here the `ar` request's
/// with its prompt, kept just before); a prompt that differs from its first token reads nothing.
#[test]
fn refusion_prompts_that_begin_alike_share_their_common_pages() -> Result<()> {
    use crate::slot_diffusion::test_support::{fixture_files, prompt};
    let common = prompt(40, 3);
    let with = |salt| begins_with(&common, prompt(8, salt));
    let ar = || SchemeParams::Ar(ArParams::default());
    let pi = || SchemeParams::PlanInfill(crate::request::PlanInfillParams::default());
    let specs = vec![
        GenerateSpec::greedy(with(5), 8, 0, ar()),
        GenerateSpec::greedy(with(6), 8, 0, ar()),
        GenerateSpec::greedy(with(6), 16, 0, pi()),
        GenerateSpec::greedy(with(7), 16, 0, pi()),
        GenerateSpec::greedy(prompt(48, 4), 8, 0, ar()),
    ];
    let shared = after_one_another(fixture_files, "refusion", &specs)?;
    assert_eq!(shared, [0, 32, 32, 0, 0]);
    Ok(())
}

/// DiffusionGemma's causal encoder: a request reads the encoded rows of its prompt's longest
/// common prefix with a kept one's (40 common tokens of 48: two pages), whatever the seeds (their
/// canvases' noise), and decodes what it decodes alone.
#[test]
fn diffusion_gemma_prompts_that_begin_alike_share_their_encoded_prefix() -> Result<()> {
    use crate::request::EntropyBoundParams;
    let eb = SchemeParams::EntropyBound(EntropyBoundParams {
        max_denoising_steps: Some(6),
        stability_threshold: Some(1),
        confidence_threshold: Some(0.6),
        ..EntropyBoundParams::default()
    });
    let ids = |n: u32, salt: u32| -> Vec<u32> {
        (0..n)
            .map(|i| 21 + (i * 37 + 202 + salt * 53) % 419)
            .collect()
    };
    let common = ids(40, 0);
    let specs = vec![
        GenerateSpec::greedy(begins_with(&common, ids(8, 1)), 16, 0, eb.clone()),
        GenerateSpec::greedy(begins_with(&common, ids(8, 2)), 16, 1, eb.clone()),
        GenerateSpec::greedy(ids(48, 3), 16, 0, eb),
    ];
    let files = || {
        let dir = wavefront_models::device::test_fixture("diffusion_gemma");
        Ok(ModelFiles::from_dir(dir)?)
    };
    assert_eq!(
        after_one_another(files, "diffusion_gemma", &specs)?,
        [0, 32, 0]
    );
    Ok(())
}

/// Huginn's static `ar` reads the common prefix of a kept prompt too, where the rows' other
/// inputs agree: zero initial states whatever the seed, or drawn ones of the same seed (its
/// draws for the shared positions are drawn and dropped); not with other recurrences or
/// another seed's draws.
#[test]
fn huginn_prompts_that_begin_alike_share_their_common_pages() -> Result<()> {
    use crate::recurrent_depth::test_support::{ar_static, fixture_files, prompt};
    let common = prompt(40, 1);
    let with = |salt| begins_with(&common, prompt(8, salt));
    let zero = |steps| huginn_zero_states(steps, "full");
    let specs = vec![
        GenerateSpec::greedy(with(2), 6, 0, zero(4)),
        GenerateSpec::greedy(with(3), 6, 1, zero(4)),
        GenerateSpec::greedy(with(4), 6, 0, zero(3)),
        GenerateSpec::greedy(with(5), 6, 7, ar_static(4, "full")),
        GenerateSpec::greedy(with(6), 6, 7, ar_static(4, "full")),
        GenerateSpec::greedy(with(7), 6, 8, ar_static(4, "full")),
    ];
    let shared = after_one_another(fixture_files, "huginn", &specs)?;
    assert_eq!(shared, [0, 32, 0, 0, 32, 0]);
    Ok(())
}

/// The prefix cache for the families whose prompt state is not ReFusion's pages: Huginn's
/// per-recurrence pages (zero initial states), LLaDA2.0's whole blocks, DiffusionGemma's encoded
/// prompt, and ARMT's memories (copied, no pages read: its shared rows are the memory segments'
/// tokens it skipped).
#[test]
fn every_sharing_family_reads_a_finished_requests_prompt_state() -> Result<()> {
    use crate::request::{BlockDiffusionParams, EntropyBoundParams};
    {
        use crate::recurrent_depth::test_support::{fixture_files, prompt};
        let zero = huginn_zero_states(4, "full");
        let specs: Vec<GenerateSpec> = (0..2)
            .map(|seed| GenerateSpec::greedy(prompt(40, 1), 6, seed, zero.clone()))
            .collect();
        assert_eq!(after_one_another(fixture_files, "huginn", &specs)?, [0, 32]);
    }
    {
        let bd = SchemeParams::BlockDiffusion(BlockDiffusionParams {
            block_length: 8,
            steps: 4,
            threshold: 0.9,
            ..BlockDiffusionParams::default()
        });
        let specs: Vec<GenerateSpec> = (0..2)
            .map(|seed| GenerateSpec::greedy(ids(38, 1), 16, seed, bd.clone()))
            .collect();
        let files = || {
            Ok(ModelFiles::from_dir(
                wavefront_models::device::test_fixture("llada2"),
            )?)
        };
        assert_eq!(after_one_another(files, "llada2", &specs)?, [0, 32]);
    }
    {
        let eb = SchemeParams::EntropyBound(EntropyBoundParams {
            max_denoising_steps: Some(6),
            stability_threshold: Some(1),
            confidence_threshold: Some(0.6),
            ..EntropyBoundParams::default()
        });
        let p: Vec<u32> = (0..40u32).map(|i| 21 + (i * 37 + 202) % 419).collect();
        let specs: Vec<GenerateSpec> = (0..2)
            .map(|seed| GenerateSpec::greedy(p.clone(), 16, seed, eb.clone()))
            .collect();
        let files = || {
            let dir = wavefront_models::device::test_fixture("diffusion_gemma");
            Ok(ModelFiles::from_dir(dir)?)
        };
        assert_eq!(
            after_one_another(files, "diffusion_gemma", &specs)?,
            [0, 32]
        );
    }
    {
        use crate::recurrent_memory::test_support::{ar, fixture_files, prompt};
        use crate::request::Execution;
        let specs: Vec<GenerateSpec> = (0..2)
            .map(|seed| GenerateSpec::greedy(prompt(30, 1), 8, seed, ar(Execution::Sequential)))
            .collect();
        assert_eq!(after_one_another(fixture_files, "armt", &specs)?, [0, 24]);
    }
    Ok(())
}

/// Prompt rows a request read from another's pages.
fn shared_rows(out: &Outcome) -> u64 {
    out.stats
        .counters
        .get("shared_prompt_tokens")
        .copied()
        .unwrap_or(0)
}

/// Huginn's static `ar` with zero initial states (`init_scale` 0): its prompt rows do not
/// depend on the seed.
fn huginn_zero_states(steps: usize, cache: &str) -> SchemeParams {
    let mut s = crate::recurrent_depth::test_support::ar_static(steps, cache);
    if let SchemeParams::Ar(a) = &mut s {
        a.init_scale = Some(0.0);
    }
    s
}

/// `common` followed by `tail`: a prompt that begins like the others made from `common`.
fn begins_with(common: &[u32], tail: Vec<u32>) -> Vec<u32> {
    let mut p = common.to_vec();
    p.extend(tail);
    p
}

/// Serves every request alone, then all of them submitted at once: each decodes the same tokens
/// both times; returns the rows each read from another request's pages when together. The
/// prefix cache is off, so only running requests donate (the alone runs share nothing).
fn together_and_alone(files: ModelFiles, name: &str, specs: &[GenerateSpec]) -> Result<Vec<u64>> {
    let served = load_model(files, no_prefix_cache(name, specs.len()))?;
    let alone = specs
        .iter()
        .map(|s| collect(&submit(served.as_ref(), s.clone())?, Vec::new()))
        .collect::<Result<Vec<_>>>()?;
    ensure!(
        alone.iter().all(|o| shared_rows(o) == 0),
        "a request alone shared"
    );
    let receivers = specs
        .iter()
        .map(|s| submit(served.as_ref(), s.clone()))
        .collect::<Result<Vec<_>>>()?;
    let together = receivers
        .iter()
        .map(|rx| collect(rx, Vec::new()))
        .collect::<Result<Vec<_>>>()?;
    for (i, (a, t)) in alone.iter().zip(&together).enumerate() {
        ensure!(
            (&a.tokens, a.reason) == (&t.tokens, t.reason),
            "request {i}: together {:?} {:?}, alone {:?} {:?}",
            t.tokens,
            t.reason,
            a.tokens,
            a.reason
        );
    }
    wait_for_free_slots(served.as_ref(), Duration::from_secs(30))?;
    served.shutdown();
    Ok(together.iter().map(shared_rows).collect())
}

/// ReFusion: three `ar` choices of one 40-token prompt (greedy, and two sampled with seeds
/// apart) and two plan-and-infill requests with it share its first two pages (32 rows; the
/// two schemes write the prompt's rows alike); a request with another prompt shares nothing.
#[test]
fn refusion_ar_choices_share_their_prompt_pages() -> Result<()> {
    use crate::slot_diffusion::test_support::{fixture_files, prompt};
    let p = prompt(40, 3);
    let ar = || SchemeParams::Ar(ArParams::default());
    let mut specs = vec![GenerateSpec::greedy(p.clone(), 8, 0, ar())];
    for seed in [1, 2] {
        let mut s = GenerateSpec::greedy(p.clone(), 8, seed, ar());
        s.sampling.temperature = 0.9;
        specs.push(s);
    }
    let pi = || SchemeParams::PlanInfill(crate::request::PlanInfillParams::default());
    specs.push(GenerateSpec::greedy(p.clone(), 16, 0, pi()));
    let mut sampled = GenerateSpec::greedy(p.clone(), 16, 5, pi());
    sampled.sampling.temperature = 0.7;
    specs.push(sampled);
    specs.push(GenerateSpec::greedy(prompt(40, 4), 8, 0, ar()));
    let shared = together_and_alone(fixture_files()?, "refusion", &specs)?;
    assert_eq!(shared, [0, 32, 32, 32, 32, 0]);
    Ok(())
}

fn ids(len: usize, salt: u32) -> Vec<u32> {
    (0..len as u32)
        .map(|i| (i * 37 + salt * 101 + 11) % 470)
        .collect()
}

/// LLaDA2.0's block diffusion: a prompt's whole blocks depend on their ids and the block
/// length alone. Three choices of a 38-token prompt in blocks of 8 share its first 32 rows
/// (two pages ending on a block boundary); a request whose prompt has the same whole blocks
/// and another tail shares them too; blocks of 16 share only with blocks of 16.
#[test]
fn llada2_requests_share_their_prompts_whole_blocks() -> Result<()> {
    use crate::request::BlockDiffusionParams;
    let bd = |block_length| {
        SchemeParams::BlockDiffusion(BlockDiffusionParams {
            block_length,
            steps: 4,
            threshold: 0.9,
            ..BlockDiffusionParams::default()
        })
    };
    let p = ids(38, 1);
    let mut tail = p[..32].to_vec();
    tail.extend(ids(5, 2));
    let mut specs = vec![GenerateSpec::greedy(p.clone(), 16, 0, bd(8))];
    for seed in [1, 2] {
        let mut s = GenerateSpec::greedy(p.clone(), 16, seed, bd(8));
        s.sampling.temperature = 0.8;
        specs.push(s);
    }
    specs.push(GenerateSpec::greedy(tail, 16, 0, bd(8)));
    specs.push(GenerateSpec::greedy(p.clone(), 16, 0, bd(16)));
    let files = ModelFiles::from_dir(wavefront_models::device::test_fixture("llada2"))?;
    let shared = together_and_alone(files, "llada2", &specs)?;
    assert_eq!(shared, [0, 32, 32, 32, 0]);
    Ok(())
}

/// DiffusionGemma: the causal encoder's prompt rows depend on the ids alone (the sliding layers
/// read the same window either way). Three requests with a 40-token prompt and different seeds
/// (their canvases' noise) share its first two pages.
#[test]
fn diffusion_gemma_requests_share_their_encoded_prompt() -> Result<()> {
    use crate::request::EntropyBoundParams;
    let eb = || {
        SchemeParams::EntropyBound(EntropyBoundParams {
            max_denoising_steps: Some(6),
            stability_threshold: Some(1),
            confidence_threshold: Some(0.6),
            ..EntropyBoundParams::default()
        })
    };
    let p: Vec<u32> = (0..40u32).map(|i| 21 + (i * 37 + 202) % 419).collect();
    let specs: Vec<GenerateSpec> = (0..3)
        .map(|seed| GenerateSpec::greedy(p.clone(), 16, seed, eb()))
        .collect();
    let files = ModelFiles::from_dir(wavefront_models::device::test_fixture("diffusion_gemma"))?;
    let shared = together_and_alone(files, "diffusion_gemma", &specs)?;
    assert_eq!(shared, [0, 32, 32]);
    Ok(())
}

/// `--prompt-sharing false`: the same requests together compute their prompts each.
#[test]
fn prompt_sharing_can_be_switched_off() -> Result<()> {
    use crate::slot_diffusion::test_support::{fixture_files, prompt};
    let opts = LoadOptions {
        name: "refusion".into(),
        max_active: 3,
        prompt_sharing: false,
        ..LoadOptions::default()
    };
    let specs: Vec<GenerateSpec> = (0..3)
        .map(|seed| {
            GenerateSpec::greedy(
                prompt(40, 3),
                8,
                seed,
                SchemeParams::Ar(ArParams::default()),
            )
        })
        .collect();
    let outs = crate::test_support::served_outcomes(fixture_files()?, opts, &specs)?;
    assert_eq!(outs.iter().map(shared_rows).collect::<Vec<_>>(), [0, 0, 0]);
    Ok(())
}

/// ARMT: the memories a prompt's memory segments leave (every segment but the last) depend on
/// their ids and how they ran, and decoding never writes them: choices with the same memory
/// segments take copies of the first one's memories and run only their prompt segment.
/// Sequential and diagonal requests (each from a donor of its own execution), greedy and
/// sampled; a request whose memory segments differ shares nothing.
#[test]
fn armt_choices_take_the_first_ones_memories() -> Result<()> {
    use crate::recurrent_memory::test_support::{ar, fixture_files, prompt};
    use crate::request::Execution;
    // 30 tokens in segments of 8: three memory segments (24 tokens) and a prompt segment of 6.
    let p = prompt(30, 1);
    let mut specs = Vec::new();
    for execution in [Execution::Sequential, Execution::Diagonal] {
        specs.push(GenerateSpec::greedy(p.clone(), 8, 0, ar(execution)));
        let mut s = GenerateSpec::greedy(p.clone(), 8, 4, ar(execution));
        s.sampling.temperature = 0.8;
        specs.push(s);
    }
    // The same memory segments, another prompt segment.
    let mut tail = p[..24].to_vec();
    tail.extend(prompt(5, 9));
    specs.push(GenerateSpec::greedy(tail, 8, 0, ar(Execution::Sequential)));
    specs.push(GenerateSpec::greedy(
        prompt(30, 2),
        8,
        0,
        ar(Execution::Sequential),
    ));
    let shared = together_and_alone(fixture_files()?, "armt", &specs)?;
    assert_eq!(shared, [0, 24, 0, 24, 24, 0]);
    Ok(())
}

/// Huginn's static `ar`: a prompt's rows depend on its initial states too. With zero initial
/// states (`init_scale` 0) every choice shares the first one's pages whatever its seed; with
/// drawn ones only a request of the same seed does (its draws for the shared positions are
/// drawn and dropped, so the rest are the ones it takes alone); choices seeded apart, an
/// adaptive exit (it averages over a call's positions) and another recurrence count share
/// nothing.
#[test]
fn huginn_static_requests_share_prompt_pages_when_their_initial_states_agree() -> Result<()> {
    use crate::recurrent_depth::test_support::{ar_adaptive, ar_static, fixture_files, prompt};
    let p = prompt(40, 1);
    let zero = |steps| huginn_zero_states(steps, "full");
    let sampled = |mut s: GenerateSpec| {
        s.sampling.temperature = 0.8;
        s
    };
    let specs = vec![
        GenerateSpec::greedy(p.clone(), 6, 0, zero(4)),
        sampled(GenerateSpec::greedy(p.clone(), 6, 1, zero(4))),
        sampled(GenerateSpec::greedy(p.clone(), 6, 2, zero(4))),
        // Drawn initial states: the same seed shares, another does not.
        GenerateSpec::greedy(p.clone(), 6, 7, ar_static(4, "full")),
        sampled(GenerateSpec::greedy(p.clone(), 6, 7, ar_static(4, "full"))),
        GenerateSpec::greedy(p.clone(), 6, 8, ar_static(4, "full")),
        GenerateSpec::greedy(p.clone(), 6, 0, zero(3)),
        GenerateSpec::greedy(p.clone(), 6, 0, ar_adaptive(4, "latest-m4", 0.5)),
    ];
    let shared = together_and_alone(fixture_files()?, "huginn", &specs)?;
    assert_eq!(shared, [0, 32, 32, 0, 32, 0, 0, 0]);
    Ok(())
}

/// Huginn caches that keep one core slot per layer across recurrences (`compress-sN`, diffusion
/// forcing's only layout) hold a position's last recurrence alone, where the positions after it
/// read each recurrence's: such requests compute their prompts each.
#[test]
fn huginn_caches_shared_across_recurrences_do_not_share_prompts() -> Result<()> {
    use crate::recurrent_depth::test_support::{fixture_files, prompt};
    let zero = huginn_zero_states(4, "compress-s4");
    let specs: Vec<GenerateSpec> = (0..2)
        .map(|seed| GenerateSpec::greedy(prompt(40, 1), 6, seed, zero.clone()))
        .collect();
    let shared = together_and_alone(fixture_files()?, "huginn", &specs)?;
    assert_eq!(shared, [0, 0]);
    Ok(())
}
