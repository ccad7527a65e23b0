//! Checker tests: edge cases, agreement with brute force, and a long simulated history.

mod basics {
    use crate::checker::*;
    use crate::history::Operation;
    use crate::model::Model;
    use std::time::Duration;

    /// A counter whose `Bump` can never be applied: only leaving it out makes a history legal.
    struct Counter;

    #[derive(Debug, Clone, PartialEq, Eq, Hash)]
    enum In {
        Incr,
        Bump,
        Get,
    }

    impl Model for Counter {
        type State = u32;
        type Input = In;
        type Output = u32;

        fn init(&self) -> u32 {
            0
        }

        fn step(&self, s: &u32, input: &In, out: Option<&u32>) -> Option<u32> {
            match input {
                In::Incr => Some(s + 1),
                In::Bump => None,
                In::Get => out.is_none_or(|v| v == s).then_some(*s),
            }
        }
    }

    #[test]
    fn empty_history_is_linearizable() {
        assert_eq!(check(&Counter, &[], DEFAULT_BUDGET).verdict(), "linearizable");
    }

    #[test]
    fn indeterminate_operation_may_be_left_out() {
        let ops = vec![
            Operation::returned(0, In::Incr, 0, 0, 1),
            Operation::indeterminate(1, In::Bump, 2),
            Operation::returned(0, In::Get, 3, 1, 4),
        ];
        assert_eq!(check(&Counter, &ops, DEFAULT_BUDGET).verdict(), "linearizable");
        let mut determinate = ops.clone();
        determinate[1] = Operation::returned(1, In::Bump, 2, 0, 5);
        assert_eq!(
            check(&Counter, &determinate, DEFAULT_BUDGET).verdict(),
            "not-linearizable"
        );
    }

    #[test]
    fn zero_budget_is_unknown() {
        let ops = vec![Operation::returned(0, In::Incr, 0, 0, 1)];
        assert_eq!(check(&Counter, &ops, Duration::ZERO).verdict(), "unknown");
    }
}

/// Cross-checks the search against brute force on many small random register histories.
mod brute_force {
    use crate::checker::*;
    use crate::history::Operation;
    use crate::model::Model;
    use crate::models::cas_register::{CasRegister, RegisterInput, RegisterOutput};

    type Op = Operation<RegisterInput, RegisterOutput>;

    const HISTORIES: usize = 3000;
    const MAX_OPS: u64 = 7;

    /// xorshift64: a tiny deterministic generator, so failures reproduce.
    struct Rng(u64);

    impl Rng {
        fn below(&mut self, n: u64) -> u64 {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            self.0 % n
        }
    }

    fn random_op(rng: &mut Rng, client: u64) -> Op {
        let call = rng.below(20);
        let ret = call + rng.below(6);
        let v = |rng: &mut Rng| rng.below(3) as i64;
        let (input, output) = match rng.below(3) {
            0 => (
                RegisterInput::Read,
                RegisterOutput::Read([None, Some(v(rng))][rng.below(2) as usize]),
            ),
            1 => (RegisterInput::Write(v(rng)), RegisterOutput::Ok),
            _ => {
                let out = [RegisterOutput::Ok, RegisterOutput::CasFailed][rng.below(2) as usize].clone();
                (
                    RegisterInput::Cas {
                        from: v(rng),
                        to: v(rng),
                    },
                    out,
                )
            }
        };
        if rng.below(4) == 0 {
            Operation::indeterminate(client, input, call)
        } else {
            Operation::returned(client, input, call, output, ret)
        }
    }

    /// Is there an order of all determinate operations and some indeterminate ones that respects
    /// real time and the model?
    fn brute_force(ops: &[Op], done: &mut Vec<bool>, state: Option<i64>) -> bool {
        let all_done = ops.iter().zip(done.iter()).all(|(op, d)| *d || op.is_indeterminate());
        if all_done {
            return true;
        }
        for i in 0..ops.len() {
            let must_precede = |j: usize| ops[j].return_time().is_some_and(|r| r < ops[i].call_time);
            if done[i] || (0..ops.len()).any(|j| !done[j] && must_precede(j)) {
                continue;
            }
            if let Some(next) = CasRegister.step(&state, &ops[i].input, ops[i].output()) {
                done[i] = true;
                let ok = brute_force(ops, done, next);
                done[i] = false;
                if ok {
                    return true;
                }
            }
        }
        false
    }

    #[test]
    fn agrees_with_brute_force() {
        let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
        let mut seen = [0usize; 2];
        for _ in 0..HISTORIES {
            let n = 1 + rng.below(MAX_OPS);
            let ops: Vec<Op> = (0..n).map(|c| random_op(&mut rng, c)).collect();
            let expected = brute_force(&ops, &mut vec![false; ops.len()], None);
            let got = check(&CasRegister, &ops, DEFAULT_BUDGET);
            assert_eq!(got.verdict() == "linearizable", expected, "{ops:#?}");
            seen[expected as usize] += 1;
        }
        assert!(seen[0] > 100 && seen[1] > 100, "unbalanced sample {seen:?}");
    }
}

/// A long simulated history of a real register with timeouts must check quickly.
mod simulated {
    use crate::checker::*;
    use crate::history::Operation;

    use crate::models::cas_register::{CasRegister, RegisterInput, RegisterOutput};
    use std::time::{Duration, Instant};

    const CLIENTS: u64 = 5;
    const OPS: usize = 3000;
    const SEEDS: u64 = 5;
    /// Generous, for unoptimised builds on a loaded machine.
    const MAX_TIME: Duration = Duration::from_secs(10);

    struct Rng(u64);

    impl Rng {
        fn below(&mut self, n: u64) -> u64 {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            self.0 % n
        }
    }

    /// An in-flight operation: takes effect at `lin` (unless `lost`), returns at `ret`.
    struct InFlight {
        client: u64,
        input: RegisterInput,
        call: u64,
        lin: u64,
        ret: u64,
        timed_out: bool,
        lost: bool,
        output: Option<RegisterOutput>,
    }

    fn invoke(rng: &mut Rng, client: u64, now: u64) -> InFlight {
        let input = match rng.below(3) {
            0 => RegisterInput::Read,
            1 => RegisterInput::Write(rng.below(5) as i64),
            _ => RegisterInput::Cas {
                from: rng.below(5) as i64,
                to: rng.below(5) as i64,
            },
        };
        let lin = now + rng.below(4);
        let timed_out = rng.below(10) == 0;
        let lost = timed_out && rng.below(2) == 0;
        let (ret, output) = (lin + rng.below(4), None);
        InFlight {
            client,
            input,
            call: now,
            lin,
            ret,
            timed_out,
            lost,
            output,
        }
    }

    fn apply(reg: &mut Option<i64>, input: &RegisterInput) -> RegisterOutput {
        match *input {
            RegisterInput::Read => RegisterOutput::Read(*reg),
            RegisterInput::Write(v) => {
                *reg = Some(v);
                RegisterOutput::Ok
            }
            RegisterInput::Cas { from, to } if *reg == Some(from) => {
                *reg = Some(to);
                RegisterOutput::Ok
            }
            RegisterInput::Cas { .. } => RegisterOutput::CasFailed,
        }
    }

    fn simulate(rng: &mut Rng) -> Vec<Operation<RegisterInput, RegisterOutput>> {
        let (mut reg, mut ops, mut next_client) = (None, Vec::new(), CLIENTS);
        let mut flying: Vec<InFlight> = (0..CLIENTS).map(|c| invoke(rng, c, 0)).collect();
        for now in 0.. {
            for f in flying.iter_mut().filter(|f| f.lin == now && !f.lost) {
                f.output = Some(apply(&mut reg, &f.input));
            }
            for f in flying.iter_mut().filter(|f| f.ret == now) {
                let output = f.output.take().unwrap_or(RegisterOutput::Ok);
                ops.push(match f.timed_out {
                    true => Operation::indeterminate(f.client, f.input.clone(), f.call),
                    false => Operation::returned(f.client, f.input.clone(), f.call, output, now),
                });
                let client = if f.timed_out { next_client } else { f.client };
                next_client += u64::from(f.timed_out);
                *f = invoke(rng, client, now + 1);
            }
            if ops.len() >= OPS {
                let unfinished = flying
                    .into_iter()
                    .map(|f| Operation::indeterminate(f.client, f.input, f.call));
                ops.extend(unfinished);
                return ops;
            }
        }
        unreachable!()
    }

    #[test]
    fn long_simulated_history_is_linearizable_and_fast() {
        for seed in 1..=SEEDS {
            let ops = simulate(&mut Rng(0x2545_f491_4f6c_dd1d ^ seed));
            let start = Instant::now();
            let res = check(&CasRegister, &ops, Duration::from_secs(20));
            println!("{} ops checked in {:?}", ops.len(), start.elapsed());
            assert_eq!(res.verdict(), "linearizable", "seed {seed}");
            assert!(start.elapsed() < MAX_TIME, "seed {seed} took {:?}", start.elapsed());
        }
    }
}
