//! One module per subcommand of `tokenlog` (see `main.rs` for the dispatch).

pub mod bench;
pub mod bench_decoder;
pub mod bench_decoders;
pub mod bench_drain;
pub mod bench_leader;
pub mod bench_restart;
pub mod bench_stage_kills;
pub mod bench_stages;
pub mod certs;
pub mod decoder;
pub mod dev;
pub mod gateway;
pub mod generate;
pub mod keys;
pub mod node;
pub mod stage;
pub mod status;
