//! One module per subcommand of `tokenlog` (see `main.rs` for the dispatch).

/// A bench's line of output on stdout. Unlike `println!` it does not panic when stdout is
/// closed (the bench piped into `head`): the panic aborted the process and left the clusters
/// the bench started running. It tells `main` instead (`process::stdout_closed`), which stops
/// the bench and, with it, what it started.
macro_rules! say {
    () => {
        $crate::process::say(format_args!(""))
    };
    ($($t:tt)*) => {
        $crate::process::say(format_args!($($t)*))
    };
}

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

/// A count that 0 would make meaningless (threads, rounds, generations, tokens): refused by
/// clap with this message instead of silently read as 1 or as nothing to do.
pub fn at_least_one(s: &str) -> Result<usize, String> {
    match s.parse::<usize>() {
        Ok(0) => Err("must be at least 1".into()),
        Ok(n) => Ok(n),
        Err(e) => Err(format!("{s:?} is not a count: {e}")),
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_count_of_zero_or_garbage_is_refused_with_a_reason() {
        assert_eq!(super::at_least_one("3"), Ok(3));
        assert_eq!(super::at_least_one("0"), Err("must be at least 1".to_string()));
        assert!(super::at_least_one("-1").unwrap_err().contains("is not a count"));
        assert!(super::at_least_one("").unwrap_err().contains("is not a count"));
    }
}
