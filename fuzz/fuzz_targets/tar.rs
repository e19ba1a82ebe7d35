#![no_main]
//! See `strata_builder::fuzzing::tar`.

libfuzzer_sys::fuzz_target!(|data: &[u8]| strata_builder::fuzzing::tar(data));
