#![no_main]
//! See `strata_builder::fuzzing::docker_archive`.

libfuzzer_sys::fuzz_target!(|data: &[u8]| strata_builder::fuzzing::docker_archive(data));
