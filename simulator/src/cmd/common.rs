//! Options every subcommand shares, and the progress bar.

use std::path::PathBuf;

use clap::Args;
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use kindred_trainer::TrainConfig;

/// `--seed`, `--json`, `--out`.
#[derive(Debug, Clone, Args)]
pub(crate) struct Common {
    /// Seed of everything random: the same seed gives the same figures.
    #[arg(long, default_value_t = 1)]
    pub(crate) seed: u64,
    /// Print only the summary as one JSON line on stdout (tables go to stderr).
    #[arg(long)]
    pub(crate) json: bool,
    /// Write CSV and SVG plots into this folder (created if missing).
    #[arg(long, value_name = "DIR")]
    pub(crate) out: Option<PathBuf>,
}

impl Common {
    /// The output folder, created.
    pub(crate) fn out_dir(&self) -> anyhow::Result<Option<PathBuf>> {
        if let Some(dir) = &self.out {
            std::fs::create_dir_all(dir)?;
        }
        Ok(self.out.clone())
    }
}

/// Local training per round, shared by `learn` and `experiment`.
#[derive(Debug, Clone, Args)]
pub(crate) struct TrainArgs {
    /// SGD steps per round.
    #[arg(long, default_value_t = 20)]
    pub(crate) steps: usize,
    /// Minibatch size.
    #[arg(long, default_value_t = 32)]
    pub(crate) batch: usize,
    /// Learning rate.
    #[arg(long, default_value_t = 0.1)]
    pub(crate) lr: f64,
}

impl TrainArgs {
    /// The trainer's configuration.
    pub(crate) fn config(&self) -> TrainConfig {
        TrainConfig {
            steps: self.steps,
            batch: self.batch,
            lr: self.lr,
        }
    }
}

/// A progress bar on stderr, hidden with `--json` or when stderr is not a terminal.
/// A progress callback that shows each stage on `pb`.
pub(crate) fn progress_to(pb: &ProgressBar) -> impl Fn(&str, u64, u64) + Sync + '_ {
    move |stage, done, len| {
        pb.set_message(stage.to_owned());
        pb.set_length(len);
        pb.set_position(done);
    }
}

pub(crate) fn progress_bar(json: bool) -> ProgressBar {
    let pb = ProgressBar::with_draw_target(Some(1), ProgressDrawTarget::stderr());
    if json {
        pb.set_draw_target(ProgressDrawTarget::hidden());
    }
    if let Ok(style) = ProgressStyle::with_template(
        "{spinner} {prefix} {msg:>10} [{bar:30}] {pos}/{len} {elapsed_precise} (eta {eta})",
    ) {
        pb.set_style(style.progress_chars("=> "));
    }
    pb
}
