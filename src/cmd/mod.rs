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

/// A count from 1 to `MAX` (a decoder's capacity: one step's items in one append).
pub fn count_up_to<const MAX: usize>(s: &str) -> Result<usize, String> {
    match at_least_one(s)? {
        n if n > MAX => Err(format!("must be at most {MAX}")),
        n => Ok(n),
    }
}

/// A bench's `--base-port`: its log nodes listen from there, and its other processes on ports
/// counted up from it (up to a few thousand above), which must stay ports.
pub fn base_port(s: &str) -> Result<u16, String> {
    const MAX: u16 = 61_000;
    match s.parse::<u16>() {
        Ok(p) if (1024..=MAX).contains(&p) => Ok(p),
        Ok(p) => Err(format!(
            "{p} is outside 1024..={MAX} (the bench counts ports up from it)"
        )),
        Err(e) => Err(format!("{s:?} is not a port: {e}")),
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

    /// A bench's base port leaves room above it: 65534 overflowed `base + 3` (a panic in a
    /// debug build; node 3 on port 0 in a release one).
    #[test]
    fn a_base_port_too_high_or_privileged_is_refused() {
        assert_eq!(super::base_port("27100"), Ok(27_100));
        assert!(super::base_port("65534").unwrap_err().contains("outside 1024..=61000"));
        assert!(super::base_port("80").unwrap_err().contains("outside"));
        assert!(super::base_port("70000").unwrap_err().contains("is not a port"));
    }
}
