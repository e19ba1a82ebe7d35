//! strata's data model and stores.
//!
//! The pure data model — [`digest`]s, a blob's table of contents and the chunk codec ([`toc`]), layer
//! descriptors, image manifests and references ([`model`]), image configs and how layers merge them
//! ([`config`]) — does no I/O. [`store`] puts and gets those
//! objects in a backend chosen by URL (`file://` or `s3://`), verifies every read against its digest, and
//! moves tags only by compare-and-swap. [`blobread`] reads verified bytes out of a blob's uncompressed view.
//! [`gc`] deletes what no tag reaches; [`index`] is the store-wide chunk index builders dedup against.

pub mod blobread;
pub mod config;
pub mod digest;
pub mod fsutil;
pub mod fuzzing;
pub mod gc;
pub mod index;
pub mod model;
pub mod pieces;
pub mod store;
#[doc(hidden)]
pub mod testing;
pub mod toc;
