//! `jepsen-style-tests`: command-line front end of the checker.
//!
//! `jepsen-style-tests check-history --model cas-register|kv --format jepsen-log|edn FILE
//! [--budget-ms N]` prints `linearizable`, `not-linearizable` (plus a report) or `unknown`, and
//! exits 0, 1 or 2 respectively; 3 on an error (unreadable or malformed history). In the
//! violation report, `t A..B` are the line numbers of an operation's invocation and completion.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use clap::{Parser, Subcommand, ValueEnum};
use jepsen_style_tests::checker::{check, CheckResult, DEFAULT_BUDGET};
use jepsen_style_tests::model::Model;
use jepsen_style_tests::models::{CasRegister, Kv};
use jepsen_style_tests::parse::{self, EventDecoder, RawEvent};

/// Exit status when the tool itself fails.
const EXIT_ERROR: u8 = 3;

#[derive(Parser)]
#[command(version, about = "tokenlog's Jepsen-style test tools")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Check a recorded history for linearizability. Exit status: 0 linearizable,
    /// 1 not linearizable, 2 unknown (budget exhausted), 3 error.
    CheckHistory {
        /// The sequential model to check against.
        #[arg(long, value_enum)]
        model: ModelKind,
        /// The history's file format.
        #[arg(long, value_enum)]
        format: Format,
        /// Give up (answer unknown) after this many milliseconds.
        #[arg(long, default_value_t = DEFAULT_BUDGET.as_millis() as u64)]
        budget_ms: u64,
        /// The history file.
        file: PathBuf,
    },
    /// Run the fault suite: a real tokenlog cluster (3 log nodes, 2 gateways, 2 fake-model
    /// decoders, all processes of the built `tokenlog` binary on loopback), a client workload,
    /// seeded nemeses, then the checkers (exactly-once, durability, fencing, linearizability of
    /// ownership, status, completion, liveness, convergence, processes, lease-time). Writes history.jsonl, verdicts.json and
    /// timeline.html per seed under --out. Exit status: 0 all checks passed, 1 a violation.
    Run {
        /// Faults to inject, comma-separated, or `all` / `none`.
        #[arg(long, default_value = "all")]
        nemesis: String,
        /// Seconds of faults per seed (the healing phase comes after).
        #[arg(long, default_value_t = 30)]
        time: u64,
        /// First seed.
        #[arg(long, default_value_t = 1)]
        seed: u64,
        /// Number of seeds to run (seed, seed+1, ...).
        #[arg(long, default_value_t = 1)]
        seeds: u64,
        /// Concurrent clients.
        #[arg(long, default_value_t = 4)]
        clients: usize,
        /// Turn on a planted bug that the checkers must catch.
        #[arg(long, value_enum)]
        plant: Option<jepsen_style_tests::harness::Plant>,
        /// The tokenlog binary (default: next to this one).
        #[arg(long)]
        bin: Option<PathBuf>,
        /// Where reports go.
        #[arg(long, default_value = "reports")]
        out: PathBuf,
        /// Run the log nodes in network namespaces (needs root, iproute2, iptables); enables
        /// the `partition` nemesis.
        #[arg(long)]
        netns: bool,
        /// Decoders run the real SmolLM2 model (fetched into ./models on first use) instead of
        /// the fake one; slower, so use fewer clients and shorter generations.
        #[arg(long)]
        real_model: bool,
        /// Decoder 1 is a pipeline head over 3 stage processes registered in the log, with 3
        /// cold spares (implies --real-model); `all` then also takes the kill-stage,
        /// pause-stage and kill-head nemeses.
        #[arg(long)]
        pipeline: bool,
        /// 3 decoders that take planned handoffs (SIGTERM drains them) and stand by for up to
        /// 4 of each other's generations; `all` then also takes the drain, handoff and
        /// standby-kill nemeses (naming one of those implies this).
        #[arg(long)]
        handoff: bool,
        /// Keep the default node and decoder configuration instead of a stress configuration
        /// drawn from each seed (snapshots every 20-500 entries, retention 2-5 s, leases of
        /// 300-2,000 ms, an unowned deadline of 3-6 s, a model step of 1-10 ms).
        #[arg(long)]
        no_stress: bool,
        /// The decoders' stall limit (ms): a worker whose step loop makes no progress this long
        /// ends (see `tokenlog decoder --stall-ms`).
        #[arg(long, default_value_t = 30_000)]
        stall_ms: u64,
    },
    /// Run the deterministic simulation (no processes: the real state machine on every replica
    /// of a simulated replicated log, simulated decoders (or, with `--core workers`, the real
    /// ones over gRPC) and clients, seeded faults on simulated time; see
    /// `jepsen_style_tests::sim`). Prints one line per failing seed (with
    /// the first violated invariant) and `N seeds, V violations`; `--seeds 1 --seed-start S`
    /// replays seed S bit for bit (same history hash); `TOKENLOG_SIM_DUMP=DIR` writes each seed's
    /// history to `DIR/seed-S.jsonl`. Exit status: 0 no violation, 1 some.
    Sim {
        /// Number of seeds.
        #[arg(long, default_value_t = 1_000)]
        seeds: u64,
        /// First seed.
        #[arg(long, default_value_t = 1)]
        seed_start: u64,
        /// Simulated milliseconds of faults per seed (the healing phase follows).
        #[arg(long, default_value_t = 6_000)]
        time_ms: u64,
        /// Turn on a planted bug that the checkers must catch.
        #[arg(long, value_enum)]
        plant: Option<jepsen_style_tests::sim::SimPlant>,
        /// Which replicated log and decoders: the simulation's own stand-in Raft (fast), the
        /// real openraft core on the simulated disk and network (slower; production code), or
        /// `workers`: the openraft core and the real decoder workers (fake model) with the
        /// production log client over gRPC on a simulated wire (slowest; the most production code).
        #[arg(long, value_enum, default_value_t = jepsen_style_tests::sim::SimCore::StandIn)]
        core: jepsen_style_tests::sim::SimCore,
        /// Print every seed's line (counts and history hash), not only failing ones.
        #[arg(long)]
        verbose: bool,
    },
    /// Run the deterministic scenarios: one scripted fault per failure point of CONTRACT §8
    /// (1-6: a planned handoff; 7-12; 15: stages) on a real cluster, each checked by every
    /// checker plus the point's own expectations (surviving owner, frontiers, the client's
    /// prefix, no stale write, one generation whatever the status reads and re-submits, the
    /// tokens of an uninterrupted run; for 1-6 the attempt's phase, sides and epochs in the
    /// log, and the cache frontiers). Partition scenarios need root
    /// (network namespaces). Writes a report per scenario under --out. Exit status: 0 all
    /// passed, 1 a failure.
    Scenario {
        /// Scenarios to run (default: all).
        #[arg(value_enum)]
        names: Vec<jepsen_style_tests::harness::scenario::Scenario>,
        /// The tokenlog binary (default: next to this one).
        #[arg(long)]
        bin: Option<PathBuf>,
        /// Where reports go.
        #[arg(long, default_value = "reports/scenarios")]
        out: PathBuf,
        /// Turn on a planted bug that the scenarios must catch.
        #[arg(long, value_enum)]
        plant: Option<jepsen_style_tests::harness::Plant>,
        /// Decoders run the real SmolLM2 model (exact resume) instead of the fake one.
        #[arg(long)]
        real_model: bool,
    },
}

#[derive(Clone, Copy, ValueEnum)]
enum ModelKind {
    CasRegister,
    Kv,
}

#[derive(Clone, Copy, ValueEnum)]
enum Format {
    JepsenLog,
    Edn,
}

fn main() -> ExitCode {
    match run(Cli::parse()) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::from(EXIT_ERROR)
        }
    }
}

fn run(cli: Cli) -> Result<ExitCode> {
    let (model, format, budget_ms, file) = match cli.command {
        Command::CheckHistory {
            model,
            format,
            budget_ms,
            file,
        } => (model, format, budget_ms, file),
        Command::Run {
            nemesis,
            time,
            seed,
            seeds,
            clients,
            plant,
            bin,
            out,
            netns,
            real_model,
            pipeline,
            handoff,
            no_stress,
            stall_ms,
        } => {
            let opts = RunOpts {
                netns,
                real_model: real_model || pipeline,
                pipeline,
                handoff,
                stress: !no_stress,
                stall_ms,
            };
            return fault_runs(&nemesis, time, seed, seeds, clients, plant, bin, out, opts);
        }
        Command::Sim {
            seeds,
            seed_start,
            time_ms,
            plant,
            core,
            verbose,
        } => return Ok(sim_runs(seeds, seed_start, time_ms, plant, core, verbose)),
        Command::Scenario {
            names,
            bin,
            out,
            plant,
            real_model,
        } => {
            let opts = jepsen_style_tests::harness::scenario::Options { plant, real_model };
            return scenarios(names, bin, out, opts);
        }
    };
    let text = std::fs::read_to_string(&file).with_context(|| format!("reading {}", file.display()))?;
    let events = match format {
        Format::JepsenLog => parse::jepsen_log::parse(&text),
        Format::Edn => parse::edn::parse(&text),
    }
    .with_context(|| format!("parsing {}", file.display()))?;
    if events.iter().any(|e| e.key.is_none()) && matches!(model, ModelKind::Kv) {
        bail!("the kv model needs keyed events (:key), which only the edn format carries");
    }
    let budget = Duration::from_millis(budget_ms);
    match model {
        ModelKind::CasRegister => check_with(&CasRegister, &events, budget),
        ModelKind::Kv => check_with(&Kv, &events, budget),
    }
}

fn check_with<M>(model: &M, events: &[RawEvent], budget: Duration) -> Result<ExitCode>
where
    M: Model + EventDecoder<Input = <M as Model>::Input, Output = <M as Model>::Output>,
{
    let ops = parse::operations(model, events)?;
    let result = check(model, &ops, budget);
    println!("{}", result.verdict());
    Ok(match result {
        CheckResult::Linearizable => ExitCode::from(0),
        CheckResult::NotLinearizable(v) => {
            print!("{}", v.render(model));
            ExitCode::from(1)
        }
        CheckResult::Unknown => ExitCode::from(2),
    })
}

fn tokenlog_bin(bin: Option<PathBuf>) -> Result<PathBuf> {
    Ok(match bin {
        Some(b) => b,
        None => std::env::current_exe()?.with_file_name("tokenlog"),
    })
}

fn scenarios(
    names: Vec<jepsen_style_tests::harness::scenario::Scenario>,
    bin: Option<PathBuf>,
    out: PathBuf,
    opts: jepsen_style_tests::harness::scenario::Options,
) -> Result<ExitCode> {
    use jepsen_style_tests::harness::scenario::{self, Scenario};
    let bin = tokenlog_bin(bin)?;
    let names = if names.is_empty() {
        Scenario::ALL.to_vec()
    } else {
        names
    };
    let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    let mut all_ok = true;
    for sc in names {
        let dir = out.join(sc.name());
        let r = rt.block_on(scenario::run(bin.clone(), dir.clone(), sc, opts))?;
        println!("{}", r.line());
        for e in r.expectations.iter().filter(|e| !e.ok) {
            println!("  expected: {}: {}", e.what, e.detail);
        }
        for (name, v) in r.summary.verdicts.iter().filter(|(_, v)| !v.ok) {
            println!("  {name}: {:?}", v.problems);
        }
        println!("  report: {}", dir.join("timeline.html").display());
        all_ok &= r.ok;
    }
    Ok(ExitCode::from(if all_ok { 0 } else { 1 }))
}

/// `sim`: runs the seeds, prints failing ones and the summary.
fn sim_runs(
    seeds: u64,
    seed_start: u64,
    time_ms: u64,
    plant: Option<jepsen_style_tests::sim::SimPlant>,
    core: jepsen_style_tests::sim::SimCore,
    verbose: bool,
) -> ExitCode {
    use jepsen_style_tests::sim;
    if plant == Some(sim::SimPlant::LeaderRestore) && core == sim::SimCore::StandIn {
        eprintln!("error: --plant leader-restore is a Raft configuration: it needs --core openraft");
        return ExitCode::from(EXIT_ERROR);
    }
    let started = std::time::Instant::now();
    let mut total = sim::SimCounts::default();
    let (mut violations, mut first) = (0u64, None);
    sim::run_seeds(seed_start, seeds, time_ms, plant, core, |o| {
        total.add(&o.counts);
        if verbose {
            let c = &o.counts;
            println!(
                "seed {}: {} | {} requests, {} tokens, {} crashes ({} unsynced entries lost), {} partitions, {} leader changes, {} takeovers, {} indeterminate ops | history {}",
                o.seed,
                if o.ok() { "ok" } else { "VIOLATION" },
                c.requests,
                c.tokens,
                c.crashes,
                c.lost_unsynced,
                c.partitions,
                c.leader_changes,
                c.takeovers,
                c.indeterminate_ops,
                o.history_hash
            );
        }
        if !o.ok() {
            violations += 1;
            first.get_or_insert(o.seed);
            println!(
                "seed {}: {} (history {})",
                o.seed,
                o.first_violation().unwrap_or_default(),
                o.history_hash
            );
        } else if o.counts.raft_panics > 0 {
            // Not a violation (the node restarts), but worth a replay.
            println!(
                "seed {}: openraft panicked {} time(s), the node restarted (history {})",
                o.seed, o.counts.raft_panics, o.history_hash
            );
        }
    });
    let secs = started.elapsed().as_secs_f64();
    println!(
        "{seeds} seeds, {violations} violations{} | drew {} crashes ({} unsynced entries lost, {} kept torn, {} disks lost), {} disk write failures ({} nodes stopped and restarted), {} openraft panics (node restarted), {} partitions, {} leader changes, {} takeovers, {} decoder pauses, {} decoder crashes, {} decoder stops (releases), {} worker exits, {} connection resets, {} clock jumps, {} duplicated requests, {} delayed requests, {} watch reconnects, {} indeterminate ops; {} requests, {} tokens, {} pruned | {:.1} s, {:.0} seeds/s",
        first.map(|s| format!(" (first at seed {s})")).unwrap_or_default(),
        total.crashes,
        total.lost_unsynced,
        total.torn_kept,
        total.disks_lost,
        total.write_failures,
        total.storage_exits,
        total.raft_panics,
        total.partitions,
        total.leader_changes,
        total.takeovers,
        total.decoder_pauses,
        total.decoder_crashes,
        total.decoder_releases,
        total.worker_exits,
        total.connection_resets,
        total.clock_jumps,
        total.duplicates,
        total.delayed,
        total.reconnects,
        total.indeterminate_ops,
        total.requests,
        total.tokens,
        total.pruned,
        secs,
        seeds as f64 / secs.max(1e-9)
    );
    ExitCode::from(if violations == 0 { 0 } else { 1 })
}

/// How the processes of a seeded run are set up.
struct RunOpts {
    netns: bool,
    real_model: bool,
    pipeline: bool,
    handoff: bool,
    stress: bool,
    stall_ms: u64,
}

#[allow(clippy::too_many_arguments)]
fn fault_runs(
    nemesis: &str,
    time: u64,
    seed: u64,
    seeds: u64,
    clients: usize,
    plant: Option<jepsen_style_tests::harness::Plant>,
    bin: Option<PathBuf>,
    out: PathBuf,
    opts: RunOpts,
) -> Result<ExitCode> {
    use jepsen_style_tests::harness::{self, RunConfig};
    let mut faults = harness::parse_faults(nemesis)?;
    if opts.pipeline && nemesis == "all" {
        faults.extend(harness::Fault::PIPELINE);
    }
    if opts.handoff && nemesis == "all" {
        faults.extend(harness::Fault::HANDOFF);
    }
    let handoff = opts.handoff || faults.iter().any(|f| harness::Fault::HANDOFF.contains(f));
    let bin = tokenlog_bin(bin)?;
    let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    let mut all_ok = true;
    for s in seed..seed + seeds {
        let mut cfg = RunConfig::new(bin.clone(), out.join(format!("seed-{s}")), s);
        cfg.time = Duration::from_secs(time);
        cfg.faults = faults.clone();
        cfg.clients = clients;
        cfg.plant = plant;
        cfg.netns = opts.netns;
        cfg.real_model = opts.real_model;
        cfg.pipeline = opts.pipeline;
        cfg.stall_ms = opts.stall_ms;
        if opts.real_model {
            cfg.max_tokens = (8, 24);
        }
        if opts.stress {
            println!("seed {s}: stress configuration: {}", cfg.stress());
        }
        if handoff {
            cfg.decoders = 3;
            cfg.handoff_listeners = 3;
            cfg.standby = 4;
        }
        let sum = rt.block_on(harness::run(&cfg))?;
        println!("{}", harness::summary_line(&sum));
        for (name, v) in &sum.verdicts {
            if !v.ok {
                for p in &v.problems {
                    println!("  {name}: {p}");
                }
            }
        }
        println!("  report: {}", cfg.out.join("timeline.html").display());
        all_ok &= sum.ok;
    }
    Ok(ExitCode::from(if all_ok { 0 } else { 1 }))
}
