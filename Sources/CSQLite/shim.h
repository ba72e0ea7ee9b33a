#include <sqlite3.h>

/// Whether SQLite checkpoints the WAL into the database file when this connection closes (on: 0, off: 1;
/// sqlite3_db_config is variadic, which Swift cannot call).
static inline int dq_sqlite3_no_checkpoint_on_close(sqlite3 *db, int off) {
    return sqlite3_db_config(db, SQLITE_DBCONFIG_NO_CKPT_ON_CLOSE, off, (int *)0);
}
