//! The decoder's timing constants and bounds, one definition each.

use std::time::Duration;

/// How long a new owner waits to read the committed prefix it was told about at acquire.
pub const PREFIX_READ_TIMEOUT: Duration = Duration::from_secs(10);
/// The renewer renews every held lease each `lease / RENEWS_PER_LEASE` (at least every
/// `RENEW_PERIOD_MIN`), so one or two lost renewals still leave the lease alive.
pub const RENEWS_PER_LEASE: u64 = 3;
pub const RENEW_PERIOD_MIN: Duration = Duration::from_millis(50);
/// A decoder refreshes its registration at least this often (and every lease).
pub const REGISTER_PERIOD_MIN: Duration = Duration::from_secs(1);
/// A registration lives `REGISTRATION_TTL_LEASES` leases, and at least `REGISTRATION_TTL_MIN_MS`.
pub const REGISTRATION_TTL_LEASES: u64 = 5;
pub const REGISTRATION_TTL_MIN_MS: u64 = 5_000;
