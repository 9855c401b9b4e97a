//! `trainerd ckpt list|show|verify|export URL`: what a checkpoint location holds
//! ([`crate::checkpoint::inspect`] does the work).

use trainerd_storage::{CheckpointStore, Location};

use super::args::{CkptCommand, S3Args};
use crate::checkpoint::inspect;

/// The checkpoint store at `url`.
pub(crate) fn open_store(url: &str, s3: &S3Args) -> anyhow::Result<CheckpointStore> {
    let location: Location = url.parse()?;
    Ok(location.open(&s3.options())?)
}

/// Runs `trainerd ckpt ...`; its exit status.
pub(crate) fn run(command: CkptCommand) -> anyhow::Result<i32> {
    match command {
        CkptCommand::List { url, s3 } => print!("{}", inspect::list(&open_store(&url, &s3)?)?),
        CkptCommand::Show { url, sequence, s3 } => print!("{}", inspect::show(&open_store(&url, &s3)?, sequence)?),
        CkptCommand::Verify { url, sequence, s3 } => {
            let ok = inspect::verify(&open_store(&url, &s3)?, sequence, &mut std::io::stdout())?;
            if !ok {
                eprintln!("error: {url}: damaged commits (see above)");
                return Ok(crate::exit::Exit::Failed.code());
            }
        }
        CkptCommand::Export { url, output, sequence, s3 } => {
            let text = inspect::export(&open_store(&url, &s3)?, sequence, &output)?;
            println!("{text}");
        }
    }
    Ok(0)
}
