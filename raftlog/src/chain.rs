//! The per-generation hash chain (CONTRACT §6): `h_i = sha256(h_{i-1} || canonical(record_i))`,
//! starting from a genesis hash bound to the generation id.

use sha2::{Digest, Sha256};

use crate::types::{GenerationId, Record, Seq};

pub type Hash = [u8; 32];

const GENESIS_DOMAIN: &[u8] = b"tokenlog.chain.v1";

/// The hash before the first record of `generation`.
pub fn genesis(generation: GenerationId) -> Hash {
    let mut h = Sha256::new();
    h.update(GENESIS_DOMAIN);
    h.update(generation.to_be_bytes());
    h.finalize().into()
}

/// The canonical bytes of a record: what the chain commits to. Log time is not part of it, so
/// a chain depends only on who wrote which token at which position.
pub fn canonical(generation: GenerationId, seq: Seq, record: &Record) -> [u8; 24] {
    let mut out = [0u8; 24];
    out[0..8].copy_from_slice(&generation.to_be_bytes());
    out[8..12].copy_from_slice(&seq.to_be_bytes());
    out[12..20].copy_from_slice(&record.epoch.to_be_bytes());
    out[20..24].copy_from_slice(&record.token_id.to_be_bytes());
    out
}

pub fn next(prev: &Hash, generation: GenerationId, seq: Seq, record: &Record) -> Hash {
    let mut h = Sha256::new();
    h.update(prev);
    h.update(canonical(generation, seq, record));
    h.finalize().into()
}

/// The head after all of `records`.
pub fn head(generation: GenerationId, records: &[Record]) -> Hash {
    records
        .iter()
        .enumerate()
        .fold(genesis(generation), |h, (i, r)| next(&h, generation, i as Seq, r))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chain_changes_with_any_field() {
        let r = Record {
            token_id: 7,
            epoch: 1,
            log_ms: 5,
        };
        let base = head(1, &[r, r]);
        assert_ne!(base, head(2, &[r, r]), "generation id is bound");
        assert_ne!(base, head(1, &[r, Record { token_id: 8, ..r }]), "token is bound");
        assert_ne!(base, head(1, &[r, Record { epoch: 2, ..r }]), "epoch is bound");
        assert_eq!(base, head(1, &[r, Record { log_ms: 99, ..r }]), "log time is not bound");
        assert_ne!(genesis(1), head(1, &[r]));
    }
}
