#ifndef SQLITE_WAL_WRITES_H
#define SQLITE_WAL_WRITES_H

#include <sqlite3.h>

/// A SQLite VFS that writes each WAL frame with one write(2) where SQLite makes two (the frame's 24-byte
/// header, then its page), and is otherwise the default VFS ("unix").
///
/// A frame header that SQLite appends where its last write to the -wal file ended is held back until the
/// next call on the file, which SQLite makes the write of that frame's page (walWriteOneFrame); the two are
/// then written together. Any other call (a write elsewhere, a read, a sync, a size, a truncation, a file
/// control, a close) writes the held header first. Nothing is held past the call after the header, so the
/// bytes in the file, their order, when they are synced and when other connections can see them are what
/// the default VFS gives; a one-row commit of four frames makes four write calls instead of eight.
///
/// Only files SQLite opens as write-ahead logs (`SQLITE_OPEN_WAL`) are wrapped; the database file and
/// everything else is the default VFS's own file.

/// The name the VFS is registered under (`file:…?vfs=dq-wal`).
extern const char *const dq_wal_writes_vfs_name;

/// Registers the VFS (once, whatever the number of calls or threads); SQLITE_OK or SQLite's error.
int dq_wal_writes_register(void);

/// How many writes the VFS has handed to the default VFS for the WAL file of `db`'s main database, since
/// that connection opened it (for tests); SQLITE_NOTFOUND when the WAL is not open through this VFS.
int dq_wal_writes_count(sqlite3 *db, sqlite3_int64 *count);

#endif
