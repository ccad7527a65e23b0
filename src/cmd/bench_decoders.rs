//! `tokenlog bench decoders`: committed tokens/s with many concurrent generations driven by real
//! decoder processes (fake model) through a real 3-node log.
//!
//! Everything is a separate process on loopback: 3 log nodes, `--decoders` decoder processes
//! (`tokenlog decoder --fake`, capacity = generations / decoders). The bench submits
//! `--generations` generations of `--tokens` tokens each (no EOS, so each ends at exactly
//! `--tokens`), follows the decoders' `tokenlog_decoder_tokens_committed` counters, and at the end
//! checks in the log that every generation FINISHED with exactly `--tokens` records. Reported:
//! committed tokens/s over the whole run (submit to the last finish) and over the middle of it
//! (10% to 90% of the tokens committed), which excludes the start-up and the tail.

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use tokenlog_proto::raftlog as pb;
use tokenlog_raftlog::client::LogClient;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::cmd::bench::{start_tokenlog, wait_for_leader, Procs};
use crate::cmd::bench_decoder::{dargs, prompt_ids};
use crate::cmd::decoder::load_model;

#[derive(clap::Args, Clone)]
pub struct DecodersArgs {
    /// Concurrent generations (all submitted at once).
    #[arg(long, default_value_t = 1000, value_parser = clap::value_parser!(u64).range(1..))]
    pub generations: u64,
    /// Decoder processes; each gets capacity generations / decoders (rounded up).
    #[arg(long, default_value_t = 2, value_parser = clap::value_parser!(u64).range(1..=1000))]
    pub decoders: u64,
    /// Tokens per generation.
    #[arg(long, default_value_t = 1000, value_parser = clap::value_parser!(u32).range(1..=i64::from(tokenlog_raftlog::limits::GENERATION_TOKENS_MAX)))]
    pub tokens: u32,
    /// Give up after this many seconds.
    #[arg(long, default_value_t = 300)]
    pub timeout_s: u64,
    /// First loopback port (3 log nodes, then one metrics port per decoder from base + 10).
    #[arg(long, default_value_t = 27_500, value_parser = crate::cmd::base_port)]
    pub base_port: u16,
}

/// The sum of the decoders' committed-token counters (a decoder not answering counts as 0).
async fn committed(ports: &[u16]) -> u64 {
    let mut sum = 0;
    for &p in ports {
        sum += scrape(p).await.unwrap_or(0);
    }
    sum
}

/// `tokenlog_decoder_tokens_committed_total` from a decoder's `/metrics`.
async fn scrape(port: u16) -> anyhow::Result<u64> {
    let mut s = tokio::net::TcpStream::connect(("127.0.0.1", port)).await?;
    s.write_all(b"GET /metrics HTTP/1.0\r\nHost: localhost\r\n\r\n").await?;
    let mut body = String::new();
    s.read_to_string(&mut body).await?;
    let line = body
        .lines()
        .find_map(|l| l.strip_prefix("tokenlog_decoder_tokens_committed_total "))
        .context("no tokens_committed counter")?;
    Ok(line.trim().parse()?)
}

pub async fn decoders(a: DecodersArgs) -> anyhow::Result<()> {
    let (model, name) = load_model(&dargs(true, None, 1))?;
    let mut prompt = prompt_ids(model.as_ref())?;
    prompt.truncate(16);
    let dir = tempfile::tempdir()?;
    let _nodes = start_tokenlog(dir.path(), a.base_port)?;
    let addrs: Vec<String> = (0..3).map(|i| format!("127.0.0.1:{}", a.base_port + i)).collect();
    let client = LogClient::new(addrs.clone())?;
    wait_for_leader(&client).await?;
    let capacity = a.generations.div_ceil(a.decoders);
    say!(
        "bench decoders: {} generations x {} tokens, {} fake-model decoder processes of capacity {capacity}, 3 log nodes",
        a.generations, a.tokens, a.decoders
    );
    let exe = std::env::current_exe()?;
    let mut decs = Procs(Vec::new());
    let ports: Vec<u16> = (0..a.decoders as u16).map(|i| a.base_port + 10 + i).collect();
    for (i, port) in ports.iter().enumerate() {
        let log = dir.path().join(format!("decoder-{i}.log"));
        let child = Command::new(&exe)
            .args(["decoder", "--fake", "--cluster", &addrs.join(",")])
            .args(["--decoder-id", &format!("bench-fake-{i}")])
            .args(["--capacity", &capacity.to_string()])
            .args(["--metrics-listen", &format!("127.0.0.1:{port}")])
            .env("RUST_LOG", "warn")
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log)?)
            .spawn()
            .context("start decoder")?;
        decs.0.push(child);
    }
    let binding = crate::cmd::bench_decoder::binding(model.as_ref(), &prompt, a.tokens);
    let total = a.generations * u64::from(a.tokens);
    let start = Instant::now();
    let ids = submit_all(&client, &binding, a.generations).await?;
    say!(
        "submitted {} generations of {name} in {:.2} s",
        ids.len(),
        start.elapsed().as_secs_f64()
    );
    let deadline = start + Duration::from_secs(a.timeout_s);
    let (mut t10, mut t90) = (None, None);
    let mut last_print = Instant::now();
    loop {
        tokio::time::sleep(Duration::from_millis(100)).await;
        let done = committed(&ports).await;
        let at = start.elapsed();
        if t10.is_none() && done * 10 >= total {
            t10 = Some((at, done));
        }
        if t90.is_none() && done * 10 >= total * 9 {
            t90 = Some((at, done));
        }
        if last_print.elapsed() >= Duration::from_secs(2) {
            say!("  {:>6.1} s: {done:>10} of {total} tokens committed", at.as_secs_f64());
            last_print = Instant::now();
        }
        if done >= total {
            break;
        }
        for (i, c) in decs.0.iter_mut().enumerate() {
            if let Some(s) = c.try_wait()? {
                bail!(
                    "decoder {i} exited ({s}); its log: {}",
                    dir.path().join(format!("decoder-{i}.log")).display()
                );
            }
        }
        if Instant::now() > deadline {
            bail!("only {done} of {total} tokens committed after {} s", a.timeout_s);
        }
    }
    let elapsed = start.elapsed();
    check_all(&client, &ids, a.tokens).await?;
    say!(
        "committed {total} tokens in {:.2} s: {:.0} tokens/s over the whole run",
        elapsed.as_secs_f64(),
        total as f64 / elapsed.as_secs_f64()
    );
    if let (Some((a10, d10)), Some((a90, d90))) = (t10, t90) {
        let secs = (a90 - a10).as_secs_f64();
        if secs > 0.0 {
            say!(
                "middle of the run (10% -> 90% of the tokens): {:.0} tokens/s",
                (d90 - d10) as f64 / secs
            );
        }
    }
    say!(
        "checked in the log: {} generations FINISHED with {} records each",
        ids.len(),
        a.tokens
    );
    Ok(())
}

/// Submits `n` generations from 32 concurrent tasks; returns their ids.
async fn submit_all(client: &LogClient, binding: &pb::Binding, n: u64) -> anyhow::Result<Vec<u64>> {
    let tasks: Vec<_> = (0..32u64)
        .map(|t| {
            let (client, binding) = (client.clone(), binding.clone());
            tokio::spawn(async move {
                let mut ids = Vec::new();
                for j in (t..n).step_by(32) {
                    let r = client
                        .submit(pb::SubmitRequest {
                            tenant: "bench".into(),
                            request_id: format!("bench-decoders-{j}"),
                            binding: Some(binding.clone()),
                        })
                        .await?;
                    ids.push(r.generation.context("no generation")?.generation_id);
                }
                anyhow::Ok(ids)
            })
        })
        .collect();
    let mut ids = Vec::new();
    for t in tasks {
        ids.extend(t.await??);
    }
    Ok(ids)
}

/// Every generation FINISHED with exactly `tokens` records (read through the leader).
async fn check_all(client: &LogClient, ids: &[u64], tokens: u32) -> anyhow::Result<()> {
    for &id in ids {
        let g = client.generation(id).await?;
        if g.state != pb::GenerationState::Finished as i32 || g.frontier != tokens {
            bail!(
                "generation {id}: state {:?}, {} records (want FINISHED with {tokens})",
                pb::GenerationState::try_from(g.state),
                g.frontier
            );
        }
    }
    Ok(())
}
