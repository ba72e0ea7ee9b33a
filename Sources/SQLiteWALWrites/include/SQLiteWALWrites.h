#ifndef SQLITE_WAL_WRITES_H
#define SQLITE_WAL_WRITES_H

#include <sqlite3.h>

/// A SQLite VFS that writes each transaction's WAL frames with one write(2) where SQLite makes two per frame
/// (its 24-byte header, then the page), and is otherwise the default VFS ("unix").
///
/// SQLite appends a transaction's frames at consecutive offsets of the -wal file. This VFS keeps those
/// writes in a buffer of the file's own and hands them to the default VFS as one write when the
/// transaction's commit frame is complete, before SQLite publishes the frames to other connections (in the
/// wal-index, after the writes return), and before any other operation on the file: a read, a sync, a
/// size, a truncation, a file control, a close, or a write elsewhere. What reaches the disk, and when it is
/// synced, is what the default VFS would do; only the number of system calls changes (about eight per
/// single-row commit become one).
///
/// Only files SQLite opens as write-ahead logs (`SQLITE_OPEN_WAL`) are buffered; the database file and
/// everything else is the default VFS's own file.

/// The name the VFS is registered under (`file:…?vfs=dq-wal`).
extern const char *const dq_wal_writes_vfs_name;

/// Registers the VFS (once, whatever the number of calls or threads); SQLITE_OK or SQLite's error.
int dq_wal_writes_register(void);

/// How many writes the VFS has handed to the default VFS for the WAL file of `db`'s main database, since
/// that connection opened it (for tests); SQLITE_NOTFOUND when the WAL is not open through this VFS.
int dq_wal_writes_count(sqlite3 *db, sqlite3_int64 *count);

#endif
