//! Pages on demand through the real binary: a worker whose pool holds a fraction of sixteen
//! growing requests preempts and resumes them, and every stream is what the request produces
//! alone; the preemptions show in its metrics.

use wavefront_proto::v1 as pb;
use wavefront_proto::v1::generation_client::GenerationClient;

use crate::harness::{channel, spawn_worker, wait_serving};
use crate::metrics::{free_port, sample, scrape};

fn request(i: u32) -> pb::GenerateRequest {
    pb::GenerateRequest {
        prompt: Some(pb::generate_request::Prompt::TokenIds(pb::TokenIds {
            ids: (0..3 + i % 5).map(|k| 5 + (k * 31 + i * 7) % 400).collect(),
        })),
        max_new_tokens: 40,
        scheme: Some(pb::generate_request::Scheme::Ar(pb::ArScheme {
            num_steps: Some(3),
            cache_lookup_strategy: "full".into(),
            ..Default::default()
        })),
        // Seeded (the initial latent states are drawn too), greedy or sampled.
        sampling: Some(pb::SamplingParams {
            temperature: if i % 2 == 1 { 0.8 } else { 0.0 },
            seed: Some(u64::from(i)),
            ..Default::default()
        }),
        ..Default::default()
    }
}

async fn tokens(client: &mut GenerationClient<tonic::transport::Channel>, i: u32) -> Vec<u32> {
    client
        .generate(request(i))
        .await
        .unwrap_or_else(|e| panic!("request {i}: {e}"))
        .into_inner()
        .token_ids
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_small_pool_preempts_and_every_stream_matches_its_run_alone() {
    let port = free_port();
    let metrics = format!("127.0.0.1:{port}");
    // 1 MiB of pages of 16 positions of 2 · 64 floats: 128 pages; a request ends at about
    // 3 pages in each of its 2 + 12 + 2 cache slots, so sixteen of them need 5x the pool.
    let worker = spawn_worker(
        "huginn",
        &[
            "--memory-budget-mb",
            "1",
            "--max-active",
            "16",
            "--metrics-listen",
            &metrics,
        ],
    );
    wait_serving(worker.addr, "wavefront.v1.Generation").await;
    let mut client = GenerationClient::new(channel(worker.addr).await);
    let mut alone = Vec::new();
    for i in 0..16 {
        alone.push(tokens(&mut client, i).await);
    }
    let before = sample(
        &scrape(port),
        "wavefront_engine_preemptions_total{model=\"huginn\"}",
    )
    .unwrap_or(0.0);
    let together: Vec<_> = (0..16)
        .map(|i| {
            let mut c = client.clone();
            tokio::spawn(async move { tokens(&mut c, i).await })
        })
        .collect();
    for (i, (task, want)) in together.into_iter().zip(&alone).enumerate() {
        let got = task.await.unwrap();
        assert_eq!(&got, want, "request {i} under pressure");
    }
    let body = scrape(port);
    let after = sample(
        &body,
        "wavefront_engine_preemptions_total{model=\"huginn\"}",
    )
    .unwrap();
    assert!(after > before, "no preemption:\n{body}");
    assert!(
        sample(
            &body,
            "wavefront_engine_preempt_bytes_to_host_total{model=\"huginn\"}"
        )
        .is_some_and(|b| b > 0.0),
        "{body}"
    );
    assert_eq!(
        sample(&body, "wavefront_preempted_requests{model=\"huginn\"}"),
        Some(0.0)
    );
    worker.terminate();
}
