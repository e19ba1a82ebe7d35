#![no_main]
//! See `strata_builder::fuzzing::oci_text`.

libfuzzer_sys::fuzz_target!(|data: &[u8]| strata_builder::fuzzing::oci_text(data));
