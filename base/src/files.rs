//! Opening a checkpoint's files: regular files only (a FIFO blocks `open` forever and a
//! device such as /dev/zero never ends; a directory's error would say "No such device"),
//! and whole-file reads bounded, each failure an error naming the file.

use std::fs::File;
use std::io::{Error as IoError, ErrorKind, Read};
use std::path::Path;

use crate::error::{Error, Result};

/// The most bytes a JSON file of a checkpoint may hold (`config.json`,
/// `tokenizer_config.json`, an index): the largest real ones are a few MiB.
pub const MAX_JSON_BYTES: u64 = 64 << 20;

/// The most bytes `tokenizer.json` may hold (the largest published ones, with vocabularies
/// of 256k tokens and their merges, are about 35 MiB).
pub const MAX_TOKENIZER_BYTES: u64 = 512 << 20;

/// Whether there is an entry at `path`, a broken or looping link included (`exists`
/// says false for those, so a checkpoint's unreadable file was taken for an absent one):
/// reading it then fails naming it.
pub fn present(path: &Path) -> bool {
    path.symlink_metadata().is_ok()
}

/// `path` opened for reading when it is a regular file (or a link to one); the file type is
/// checked before `open`, which would block on a FIFO.
pub fn open_regular(path: &Path) -> Result<File> {
    let meta = std::fs::metadata(path).map_err(|e| Error::io(path, e))?;
    if !meta.is_file() {
        let kind =
            if meta.is_dir() { "a directory" } else { "not a regular file (a FIFO, socket or device)" };
        return Err(Error::io(
            path,
            IoError::new(ErrorKind::InvalidInput, format!("{kind}, not a file to read")),
        ));
    }
    File::open(path).map_err(|e| Error::io(path, e))
}

/// The bytes of the regular file `path`, refused when they exceed `limit`.
pub fn read_bounded(path: &Path, limit: u64) -> Result<Vec<u8>> {
    let mut bytes = Vec::new();
    open_regular(path)?
        .take(limit.saturating_add(1))
        .read_to_end(&mut bytes)
        .map_err(|e| Error::io(path, e))?;
    if bytes.len() as u64 > limit {
        let msg = format!("larger than the {} MiB this file may hold", limit >> 20);
        return Err(Error::io(path, IoError::new(ErrorKind::InvalidData, msg)));
    }
    Ok(bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn devices_directories_and_oversized_files_are_refused_by_name() {
        let dir = std::env::temp_dir().join(format!("mtp-files-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let err = read_bounded(&dir, 10).unwrap_err().to_string();
        assert!(err.contains(&dir.display().to_string()) && err.contains("a directory"), "{err}");
        let file = dir.join("f.json");
        std::fs::write(&file, b"0123456789").unwrap();
        assert_eq!(read_bounded(&file, 10).unwrap(), b"0123456789"); // the limit itself reads
        let err = read_bounded(&file, 9).unwrap_err().to_string();
        assert!(err.contains("f.json") && err.contains("larger than"), "{err}");
        #[cfg(unix)]
        {
            let err = read_bounded(Path::new("/dev/zero"), 10).unwrap_err().to_string();
            assert!(err.contains("/dev/zero") && err.contains("not a regular file"), "{err}");
        }
        std::fs::remove_dir_all(&dir).ok();
    }
}
