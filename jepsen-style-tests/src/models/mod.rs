//! Sequential models: a compare-and-set register, a key-value store, and tokenlog's
//! per-generation ownership/frontier model.

pub mod cas_register;
pub mod kv;
pub mod ownership;

pub use cas_register::CasRegister;
pub use kv::Kv;
pub use ownership::Ownership;
