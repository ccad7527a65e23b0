//! `tokenlog`: the one user-facing binary. `main` only parses and dispatches: each subcommand
//! lives in `cmd/<name>.rs`, process plumbing (tracing, signals, metrics listener) in `process`.

mod cmd;
mod process;

/// mimalloc: glibc's malloc and free were ~15% of a log node's CPU under `bench log` (perf).
#[global_allocator]
static ALLOC: mimalloc::MiMalloc = mimalloc::MiMalloc;

use clap::{Parser, Subcommand};

use cmd::{bench, certs, decoder, dev, gateway, generate, keys, node, stage, status};

#[derive(Parser)]
#[command(
    name = "tokenlog",
    version,
    about = "Keeps LLM generations alive across machine failures.",
    long_about = "tokenlog keeps LLM generations alive across machine failures: a Raft-replicated \
log holds each generation's owner (epoch + lease) and its committed tokens; decoders write only \
through epoch-fenced appends; a client that reconnects sees every token exactly once.\n\n\
Start a 3-node log on one machine:\n  \
tokenlog node --id 1 --listen 127.0.0.1:7001 --data-dir d1 --peers 1=127.0.0.1:7001,2=127.0.0.1:7002,3=127.0.0.1:7003\n  \
(and the same with --id 2 / 3)\n  \
tokenlog status --cluster 127.0.0.1:7001\n\n\
Or everything in one process, with the bundled model:\n  \
tokenlog dev\n  \
tokenlog generate \"Write a haiku about logs.\""
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// The single-machine default: a one-node log, a CPU decoder with the bundled model and a
    /// gateway, in this process (see README).
    Dev(dev::DevArgs),
    /// Run a gateway: gRPC streaming (tokenlog.v1) and the OpenAI-compatible HTTP API.
    Gateway(gateway::GatewayArgs),
    /// Generate text through a gateway, printing tokens as they are committed; survives gateway
    /// and decoder deaths (--request-id re-attaches).
    Generate(generate::GenerateArgs),
    /// Run a decoder: a model that takes generations from the log and writes their tokens.
    Decoder(decoder::DecoderArgs),
    /// Run one stage of a pipeline: a layer range of a model, driven by a pipeline head
    /// (`tokenlog decoder --pipeline ADDR,ADDR,...`), for a model split across processes.
    Stage(stage::StageArgs),
    /// Run one node of the replicated log.
    Node(node::NodeArgs),
    /// Show a cluster's leader, term, indexes, members and generations by state.
    Status(status::StatusArgs),
    /// Walk every generation's hash chain (on a stopped node's data dir, or on a live node) and
    /// report the first broken record of each.
    Verify(status::VerifyArgs),
    /// Change cluster membership: add a node (as learner, then voter) or remove voters.
    Members(status::MembersArgs),
    /// Make a CA and certificates for nodes, decoders, gateways and operators (mutual TLS with
    /// roles; for tests, compose and first deployments).
    Certs(certs::CertsArgs),
    /// API keys for a gateway's keys file (it stores only their hashes).
    #[command(subcommand)]
    Keys(keys::KeysCmd),
    /// Write a llama GGUF model as a Hugging Face model folder (f32 safetensors, config.json,
    /// tokenizer.json) that `tokenlog decoder --model DIR` runs through the safetensors path.
    ExportSafetensors(decoder::ExportArgs),
    /// Benchmarks; each prints ratios against a baseline measured in the same run.
    #[command(subcommand)]
    Bench(bench::BenchCmd),
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    process::abort_on_panic();
    process::init_tracing();
    let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    let result = rt.block_on(async {
        process::plant_task_panic()?;
        match cli.cmd {
            Cmd::Dev(a) => dev::run(a).await,
            Cmd::Decoder(a) => decoder::run(a).await,
            Cmd::Gateway(a) => gateway::run(a).await,
            Cmd::Generate(a) => generate::run(a).await,
            Cmd::Node(a) => node::run(a).await,
            Cmd::Stage(a) => stage::run(a).await,
            // Commands run for what they print: output that a closed stdout lost is an error
            // (a server's lines, its addresses, cost it nothing; it serves on).
            Cmd::Status(a) => printed(status::status(a).await),
            Cmd::Verify(a) => printed(status::verify(a).await),
            Cmd::Members(a) => printed(status::members(a).await),
            Cmd::ExportSafetensors(a) => printed(decoder::export(a)),
            Cmd::Keys(k) => printed(keys::run(k)),
            Cmd::Certs(a) => printed(certs::run(a)),
            // SIGTERM, Ctrl-C or a closed stdout drops the bench, and with it the clusters it started (their
            // processes are killed when dropped) instead of leaving them running.
            Cmd::Bench(b) => tokio::select! {
                r = bench::run(b) => match r {
                    Ok(()) if process::stdout_was_closed() => Err(anyhow::anyhow!("bench ended, but its output was closed: lines were lost")),
                    r => r,
                },
                () = process::shutdown_signal() => Err(anyhow::anyhow!("bench interrupted: the processes it started are stopped")),
                () = process::stdout_closed() => Err(anyhow::anyhow!("bench stopped: its output was closed (the processes it started are stopped)")),
            },
        }
    });
    // The command is over; what still runs on a blocking thread (a model step the stall
    // watchdog gave up on, a pipeline pass waiting for a stage) is not waited for long: the
    // runtime's drop waited for it without a limit, so a stuck decoder ended its leases and
    // then stayed alive, silent, until its step returned (30 s and more).
    rt.shutdown_timeout(BLOCKING_TASKS_GRACE);
    result
}

/// How long a finished command waits for work still running on blocking threads.
const BLOCKING_TASKS_GRACE: std::time::Duration = std::time::Duration::from_secs(2);

/// `r`, or an error when the command's output was lost to a closed stdout.
fn printed(r: anyhow::Result<()>) -> anyhow::Result<()> {
    match r {
        Ok(()) if process::stdout_was_closed() => Err(anyhow::anyhow!(
            "standard output was closed: what this command printed was lost"
        )),
        r => r,
    }
}

#[cfg(test)]
mod cli_tests {
    use clap::Parser;

    /// Why `args` are refused, or `None` when clap takes them.
    fn refused(args: &[&str]) -> Option<String> {
        let argv = std::iter::once("tokenlog").chain(args.iter().copied());
        super::Cli::try_parse_from(argv).err().map(|e| e.to_string())
    }

    #[test]
    fn counts_that_zero_would_make_meaningless_are_refused_by_name() {
        for (args, flag) in [
            (&["decoder", "--cluster", "x", "--threads", "0"][..], "--threads"),
            (&["decoder", "--cluster", "x", "--capacity", "0"][..], "--capacity"),
            (&["stage", "--layers", "0..10", "--threads", "0"][..], "--threads"),
            (&["dev", "--threads", "0"][..], "--threads"),
            (&["bench", "decode", "--concurrency", "1,0,4"][..], "--concurrency"),
            (&["bench", "decode", "--tokens", "0"][..], "--tokens"),
            (&["bench", "drain", "--rounds", "0"][..], "--rounds"),
            (&["bench", "drain", "--after", "1"][..], "--after"),
            (&["bench", "log", "--seconds", "0"][..], "--seconds"),
        ] {
            let why = refused(args).unwrap_or_else(|| panic!("{args:?} was taken"));
            assert!(why.contains(flag), "{args:?}: {why}");
        }
        assert_eq!(refused(&["bench", "decode", "--concurrency", "1,2,4,8"]), None);
        assert_eq!(refused(&["bench", "drain", "--rounds", "3"]), None);
        let why = refused(&["bench", "drain", "--rounds", "0"]).unwrap();
        assert!(why.contains("must be at least 1"), "{why}");
    }
}
