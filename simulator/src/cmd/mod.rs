//! The subcommands: argument parsing, running, and rendering (the only place that prints).

pub(crate) mod calibrate;
pub(crate) mod cohorts;
pub(crate) mod common;
pub(crate) mod experiment;
pub(crate) mod learn;
pub(crate) mod render;
pub(crate) mod routing;
