//! strata's data prefetch: trace recording, plan building, replay scheduling.
//!
//! Not written yet. The design (`../shared/DESIGN.md`, "Prefetch"): `strata trace IMAGE -- CMD` records the
//! chunks a run reads, in order, into a plan stored with the image (`plans/<manifest-digest>`); on mount
//! the daemon warms the plan in the background, below demand reads in priority and under a bandwidth cap.
