#![no_main]
//! See `strata_erofs::fuzzing::walk`.

libfuzzer_sys::fuzz_target!(|data: &[u8]| strata_erofs::fuzzing::walk(data));
