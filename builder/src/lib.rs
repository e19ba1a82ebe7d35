//! strata's layer builder.
//!
//! A build reads a [`source`] (a directory or a tar stream) into a [`tree::Tree`], cuts regular files into
//! fixed-size chunks on all cores (BLAKE3 digest, zstd), deduplicates them within the layer, against its
//! parents and against every blob of the store ([`dedup`]), writes the new chunks into one blob with its table of contents, and lays the tree out as an
//! EROFS metadata image ([`erofs`]) whose chunk indexes point into the blobs' uncompressed views through the
//! device table. The blob, the metadata and the layer descriptor are then stored, in that order. A layer
//! is named by its content ([`identity`]), not by where its chunks went: a build whose layer the store
//! holds already stores nothing.
//!
//! [`oci`] reads OCI image layouts and `docker save` archives; [`import`] turns their layers into strata
//! layers, verifying every digest on the way and reusing layers imported before.

pub mod erofs;
pub mod error;
pub mod source;
pub mod tree;

pub use error::{BuildError, TarError, TarPlace};
pub mod build;
pub mod chunker;
pub mod chunkmap;
pub mod compact;
pub mod dedup;
mod devices;
pub mod elfdeps;
pub mod flatten;
pub mod fuzzing;
pub mod identity;
pub mod import;
pub mod layout;
mod lower;
pub mod oci;

pub use build::{build_dir, build_tar, build_with, BuildOptions, BuiltLayer};
