//! Where a network's state lives under the data directory, and whether
//! that place may be used: the store's directories are made only where
//! nobody but root and this user can change them (see [`crate::trust`]),
//! never through a symlink. Judged before the store opens anything, by the
//! store and by every caller that checks an invocation first.

use std::fs::DirBuilder;
use std::os::unix::fs::DirBuilderExt;
use std::path::{Path, PathBuf};

use crate::trust::{self, Refusal};

use crate::Error;

/// An error of the store's files: `what` `path`, then the cause.
pub fn io_error(what: &str, path: &Path) -> impl Fn(std::io::Error) -> Error {
    let what = format!("{what} {}", path.display());
    move |source| Error::File {
        what: what.clone(),
        source,
    }
}

/// `<dataDir>/.sled`: every database of a data directory, and what is kept
/// beside them under names that start with a dot. No network name starts
/// with a dot, so none of those can ever be a network's database.
pub fn sled_dir(data_dir: &Path) -> PathBuf {
    data_dir.join(".sled")
}

/// Where one network's state lives.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Paths {
    /// `<dataDir>/<network>`: the reference plugin's directory, holding the
    /// shared `lock` (and, on a migrated node, its lease files).
    pub reference_dir: PathBuf,
    /// `<dataDir>/.sled/<network>`: the database.
    pub db_dir: PathBuf,
    /// The network's name, a file name three times over.
    pub network: String,
}

/// The longest name a directory entry may have (Linux's `NAME_MAX`): the
/// network's name is one, three times (see [`Paths`]).
const NAME_MAX: usize = 255;

/// The longest path the kernel takes (`PATH_MAX`, its NUL included).
const PATH_MAX: usize = 4096;

/// The longest name sled gives a file in a database's directory (a
/// snapshot it is writing; its blobs and other files are shorter).
const LONGEST_SLED_FILE: &str = "snap.0000000000000000.generating";

impl Paths {
    /// A network's places under `data_dir`. A name that cannot be a file
    /// name there (libcni's characters; at most [`NAME_MAX`] bytes), or a
    /// data directory so long that the store's files could not be opened,
    /// is refused with the error creating them would give, before anything
    /// is created.
    pub fn new(data_dir: &Path, network: &str) -> Result<Self, Error> {
        cni::env::validate_network_name(network).map_err(Error::Cni)?;
        let paths = Paths {
            reference_dir: data_dir.join(network),
            db_dir: sled_dir(data_dir).join(network),
            network: network.to_owned(),
        };
        let too_long = |path: &Path| {
            io_error("cannot create", path)(std::io::Error::from_raw_os_error(nix::libc::ENAMETOOLONG))
        };
        if network.len() > NAME_MAX {
            return Err(too_long(&paths.reference_dir));
        }
        let longest = paths.db_dir.join(LONGEST_SLED_FILE);
        if longest.as_os_str().len() >= PATH_MAX {
            return Err(too_long(&longest));
        }
        Ok(paths)
    }

    /// Checks, without creating anything, that this network's directories
    /// are, or can be made, what the store takes: each one that exists is a
    /// directory itself (no symlink) that nobody but root and this user can
    /// change; each one missing can be made here, in a directory trusted as
    /// a place to make one. What it refuses, opening the store would refuse
    /// too, after making some of them (and a lease service would have been
    /// started for nothing). One walk from `/` judges the data directory;
    /// the store's own directories in it are then judged one by one.
    pub fn check_place(&self) -> Result<(), Error> {
        let data_dir = match self.reference_dir.parent() {
            Some(dir) if !dir.as_os_str().is_empty() => dir,
            _ => Path::new("."),
        };
        let cannot = io_error("cannot create", &self.reference_dir);
        match std::fs::metadata(data_dir) {
            Ok(meta) if meta.is_dir() => {}
            Ok(_) => return Err(cannot(std::io::Error::from_raw_os_error(nix::libc::ENOTDIR))),
            // Everything is made below one ancestor.
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return creatable_dir(&self.reference_dir),
            Err(e) => return Err(cannot(e)),
        }
        let resolved = trust::trusted_parent(data_dir).map_err(|refusal| match refusal {
            Refusal::Absent(e) => cannot(e),
            Refusal::Untrusted(why) => untrusted_store(&self.reference_dir, &why),
        })?;
        for dir in [self.reference_dir.as_path(), self.sled_dir()] {
            match std::fs::symlink_metadata(dir) {
                Ok(meta) => {
                    existing_private_dir(dir, &meta)?;
                    trusted_store_child(dir, &resolved.join(dir.file_name().unwrap_or_default()), &meta)?;
                }
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => writable_parent(data_dir, dir)?,
                Err(e) => return Err(io_error("cannot create", dir)(e)),
            }
        }
        if let Ok(meta) = std::fs::symlink_metadata(&self.db_dir) {
            real_dir(&self.db_dir)?;
            let place = resolved.join(".sled").join(&self.network);
            trusted_store_child(&self.db_dir, &place, &meta)?;
        }
        let witnesses = self.witness_dir();
        if std::fs::symlink_metadata(&witnesses).is_ok() {
            real_dir(&witnesses)?;
        }
        Ok(())
    }

    pub fn lock_file(&self) -> PathBuf {
        self.reference_dir.join("lock")
    }

    pub fn sled_dir(&self) -> &Path {
        self.db_dir.parent().unwrap_or(&self.db_dir)
    }

    /// `<dataDir>/.sled/.generations/<network>`: how many changes the
    /// database had committed, written after each flush, outside sled and
    /// outside its directory (a database restored from an old copy comes
    /// without a matching witness).
    pub fn witness(&self) -> PathBuf {
        self.witness_dir().join(&self.network)
    }

    pub fn witness_dir(&self) -> PathBuf {
        self.sled_dir().join(".generations")
    }

    /// Where versions before the `.generations` directory kept the witness:
    /// `<dataDir>/.sled/<network>.generation`, which is also the database of
    /// the network named `<network>.generation`, and too long a file name
    /// for network names of 245 characters and more.
    pub fn legacy_witness(&self) -> PathBuf {
        self.sled_dir().join(format!("{}.generation", self.network))
    }
}

/// Creates a directory of the store (0700) if needed, and refuses one that
/// is a symlink: nothing of the store is reached through one.
pub fn private_dir(path: &Path) -> Result<(), Error> {
    DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(path)
        .map_err(io_error("cannot create", path))?;
    real_dir(path)
}

/// What [`private_dir`] says of `path`, which exists (`meta`, not
/// following links): a symlink to a directory is refused as such, anything
/// else that is no directory as mkdir's `EEXIST`.
fn existing_private_dir(path: &Path, meta: &std::fs::Metadata) -> Result<(), Error> {
    if meta.file_type().is_dir() {
        Ok(())
    } else if std::fs::metadata(path).is_ok_and(|target| target.is_dir()) {
        real_dir(path)
    } else {
        Err(io_error("cannot create", path)(
            std::io::Error::from_raw_os_error(nix::libc::EEXIST),
        ))
    }
}

/// Whether [`private_dir`] could make the missing `path`: its nearest
/// existing ancestor is a directory (links followed, as mkdir's are) that
/// this process may write and search, trusted as a parent of the store's
/// directories (see [`trust::trusted_parent`]). Errors are the ones
/// making it, or [`trust_store`] after it, would give.
fn creatable_dir(path: &Path) -> Result<(), Error> {
    let cannot = io_error("cannot create", path);
    let mut ancestor = path.parent();
    while let Some(dir) = ancestor {
        // A relative path's last ancestor is "": the working directory.
        let dir = if dir.as_os_str().is_empty() {
            Path::new(".")
        } else {
            dir
        };
        match std::fs::metadata(dir) {
            Ok(meta) if meta.is_dir() => {
                writable_parent(dir, path)?;
                return trust::trusted_parent(dir)
                    .map(drop)
                    .map_err(|refusal| match refusal {
                        Refusal::Absent(e) => cannot(e),
                        Refusal::Untrusted(why) => untrusted_store(path, &why),
                    });
            }
            Ok(_) => return Err(cannot(std::io::Error::from_raw_os_error(nix::libc::ENOTDIR))),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => ancestor = dir.parent(),
            Err(e) => return Err(cannot(e)),
        }
    }
    Ok(())
}

/// Whether this process may make `path` in the directory `parent` (a
/// read-only file system, or no permission, is what mkdir would say).
fn writable_parent(parent: &Path, path: &Path) -> Result<(), Error> {
    use nix::unistd::{AccessFlags, access};
    access(parent, AccessFlags::W_OK | AccessFlags::X_OK)
        .map_err(|errno| io_error("cannot create", path)(errno.into()))
}

/// [`trust_store`]'s judgement of an existing directory of the store
/// (`meta`, not a link) whose parent was found trusted; `place` is where it
/// is, links resolved.
fn trusted_store_child(dir: &Path, place: &Path, meta: &std::fs::Metadata) -> Result<(), Error> {
    trust::trusted_child(place, meta).map_err(|refusal| match refusal {
        Refusal::Absent(e) => io_error("cannot read", dir)(e),
        Refusal::Untrusted(why) => untrusted_store(dir, &why),
    })
}

fn untrusted_store(dir: &Path, why: &str) -> Error {
    Error::Store(format!("the lease store {} is not used: {why}", dir.display()))
}

/// [`trust::trusted_dir`] for a directory of the store, with the
/// store's errors.
fn trusted_store_dir(dir: &Path) -> Result<(), Error> {
    trust::trusted_dir(dir)
        .map(drop)
        .map_err(|refusal| match refusal {
            Refusal::Absent(e) => io_error("cannot read", dir)(e),
            Refusal::Untrusted(why) => untrusted_store(dir, &why),
        })
}

/// Fails unless `path` is a directory itself, not a symlink to one.
pub fn real_dir(path: &Path) -> Result<(), Error> {
    let meta = std::fs::symlink_metadata(path).map_err(io_error("cannot read", path))?;
    if meta.file_type().is_dir() {
        Ok(())
    } else {
        Err(Error::Store(format!(
            "{} is not a directory (a symlink?); the lease store follows none",
            path.display()
        )))
    }
}

/// Refuses a store that another user could change: its directories and
/// every directory above them must belong to root or this user and be
/// writable by nobody else (see [`trust::trusted_dir`]). Otherwise
/// a symlink or file planted there would steer root's writes.
pub fn trust_store(paths: &Paths) -> Result<(), Error> {
    let mut dirs = vec![paths.reference_dir.as_path(), paths.sled_dir()];
    if std::fs::symlink_metadata(&paths.db_dir).is_ok() {
        real_dir(&paths.db_dir)?;
        dirs.push(&paths.db_dir);
    }
    for dir in dirs {
        trusted_store_dir(dir)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The data directory's service listens among the databases it keeps
    /// open (named without knowing the store).
    #[test]
    fn the_services_socket_is_in_the_stores_directory() {
        let data_dir = Path::new("/var/lib/cni/networks");
        assert_eq!(
            crate::lease_settings::data_dir_socket(data_dir).parent(),
            Some(sled_dir(data_dir).as_path())
        );
    }
}
