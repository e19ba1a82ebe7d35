#![no_main]
//! See `strata_registry::fuzzing::documents`.

libfuzzer_sys::fuzz_target!(|data: &[u8]| strata_registry::fuzzing::documents(data));
