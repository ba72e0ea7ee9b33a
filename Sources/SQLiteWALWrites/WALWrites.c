// See include/SQLiteWALWrites.h.
#include "SQLiteWALWrites.h"

#include <pthread.h>
#include <sqlite3.h>
#include <string.h>

const char *const dq_wal_writes_vfs_name = "dq-wal";

/// A WAL frame's header is 24 bytes; a page is at most 65,536.
enum { frameHeaderSize = 24, largestPage = 65536 };
/// The file control that reads a WAL file's write count (an opcode SQLite does not use).
enum { countControl = 0x64710001 };

typedef struct WALFile {
    sqlite3_file base;
    /// The default VFS's file, in the memory right after this struct (see szOsFile).
    sqlite3_file *real;
    /// A frame header held back (its first 24 bytes), then the header and its page, written as one.
    unsigned char *frame;
    /// Whether `frame` holds a header not yet written, and where it goes.
    int held;
    sqlite3_int64 heldOffset;
    /// Where the last write ended (-1 before the first).
    sqlite3_int64 end;
    /// Writes handed to the default VFS.
    sqlite3_int64 writes;
} WALFile;

static sqlite3_vfs *parent;
static sqlite3_vfs vfs;
static sqlite3_io_methods methods;
static pthread_once_t once = PTHREAD_ONCE_INIT;
static int registered = SQLITE_ERROR;

static int writeThrough(WALFile *file, const void *bytes, int amount, sqlite3_int64 offset) {
    file->writes += 1;
    return file->real->pMethods->xWrite(file->real, bytes, amount, offset);
}

/// Writes a header held back, if any. Every call on the file but the page write that completes the frame
/// comes here first, so a header is never held past the call after it.
static int flush(WALFile *file) {
    if (!file->held) return SQLITE_OK;
    file->held = 0;
    return writeThrough(file, file->frame, frameHeaderSize, file->heldOffset);
}

static int walWrite(sqlite3_file *handle, const void *bytes, int amount, sqlite3_int64 offset) {
    WALFile *file = (WALFile *)handle;
    if (file->held) {
        if (offset == file->heldOffset + frameHeaderSize && amount <= largestPage) {
            // The page of the header held back: both in one write.
            file->held = 0;
            memcpy(file->frame + frameHeaderSize, bytes, (size_t)amount);
            file->end = offset + amount;
            return writeThrough(file, file->frame, frameHeaderSize + amount, file->heldOffset);
        }
        int rc = flush(file);
        if (rc != SQLITE_OK) return rc;
    }
    // A frame header appended where the last write ended is held until the next call, which SQLite makes
    // the write of its page. Headers written anywhere else (SQLite rewriting the checksums of frames already
    // in the log) go through at once.
    if (amount == frameHeaderSize && offset == file->end) {
        memcpy(file->frame, bytes, frameHeaderSize);
        file->held = 1;
        file->heldOffset = offset;
        file->end = offset + amount;
        return SQLITE_OK;
    }
    file->end = offset + amount;
    return writeThrough(file, bytes, amount, offset);
}

static int walClose(sqlite3_file *handle) {
    WALFile *file = (WALFile *)handle;
    int rc = flush(file);
    int closed = file->real->pMethods->xClose(file->real);
    sqlite3_free(file->frame);
    file->frame = 0;
    return rc != SQLITE_OK ? rc : closed;
}

static int walRead(sqlite3_file *handle, void *bytes, int amount, sqlite3_int64 offset) {
    WALFile *file = (WALFile *)handle;
    int rc = flush(file);
    return rc != SQLITE_OK ? rc : file->real->pMethods->xRead(file->real, bytes, amount, offset);
}

static int walTruncate(sqlite3_file *handle, sqlite3_int64 size) {
    WALFile *file = (WALFile *)handle;
    int rc = flush(file);
    return rc != SQLITE_OK ? rc : file->real->pMethods->xTruncate(file->real, size);
}

static int walSync(sqlite3_file *handle, int flags) {
    WALFile *file = (WALFile *)handle;
    int rc = flush(file);
    return rc != SQLITE_OK ? rc : file->real->pMethods->xSync(file->real, flags);
}

static int walFileSize(sqlite3_file *handle, sqlite3_int64 *size) {
    WALFile *file = (WALFile *)handle;
    int rc = flush(file);
    return rc != SQLITE_OK ? rc : file->real->pMethods->xFileSize(file->real, size);
}

static int walFileControl(sqlite3_file *handle, int op, void *argument) {
    WALFile *file = (WALFile *)handle;
    if (op == countControl) {
        *(sqlite3_int64 *)argument = file->writes;
        return SQLITE_OK;
    }
    int rc = flush(file);
    return rc != SQLITE_OK ? rc : file->real->pMethods->xFileControl(file->real, op, argument);
}

static int walLock(sqlite3_file *handle, int level) {
    WALFile *file = (WALFile *)handle;
    return file->real->pMethods->xLock(file->real, level);
}

static int walUnlock(sqlite3_file *handle, int level) {
    WALFile *file = (WALFile *)handle;
    return file->real->pMethods->xUnlock(file->real, level);
}

static int walCheckReservedLock(sqlite3_file *handle, int *reserved) {
    WALFile *file = (WALFile *)handle;
    return file->real->pMethods->xCheckReservedLock(file->real, reserved);
}

static int walSectorSize(sqlite3_file *handle) {
    WALFile *file = (WALFile *)handle;
    return file->real->pMethods->xSectorSize(file->real);
}

static int walDeviceCharacteristics(sqlite3_file *handle) {
    WALFile *file = (WALFile *)handle;
    return file->real->pMethods->xDeviceCharacteristics(file->real);
}

static int vfsOpen(sqlite3_vfs *self, const char *name, sqlite3_file *handle, int flags, int *outFlags) {
    (void)self;
    // Anything but a WAL file is the default VFS's file, in the same memory.
    if (!(flags & SQLITE_OPEN_WAL)) return parent->xOpen(parent, name, handle, flags, outFlags);
    WALFile *file = (WALFile *)handle;
    memset(file, 0, sizeof *file);
    file->real = (sqlite3_file *)(file + 1);
    file->end = -1;
    file->frame = sqlite3_malloc(frameHeaderSize + largestPage);
    if (!file->frame) return SQLITE_NOMEM;
    int rc = parent->xOpen(parent, name, file->real, flags, outFlags);
    if (rc != SQLITE_OK) {
        // SQLite calls xClose only when pMethods is set; the default VFS cleans up its own failed open.
        sqlite3_free(file->frame);
        file->frame = 0;
        return rc;
    }
    file->base.pMethods = &methods;
    return SQLITE_OK;
}

static int vfsDelete(sqlite3_vfs *self, const char *name, int syncDirectory) {
    (void)self;
    return parent->xDelete(parent, name, syncDirectory);
}

static int vfsAccess(sqlite3_vfs *self, const char *name, int flags, int *result) {
    (void)self;
    return parent->xAccess(parent, name, flags, result);
}

static int vfsFullPathname(sqlite3_vfs *self, const char *name, int size, char *out) {
    (void)self;
    return parent->xFullPathname(parent, name, size, out);
}

static void *vfsDlOpen(sqlite3_vfs *self, const char *name) {
    (void)self;
    return parent->xDlOpen(parent, name);
}

static void vfsDlError(sqlite3_vfs *self, int size, char *message) {
    (void)self;
    parent->xDlError(parent, size, message);
}

static void (*vfsDlSym(sqlite3_vfs *self, void *library, const char *symbol))(void) {
    (void)self;
    return parent->xDlSym(parent, library, symbol);
}

static void vfsDlClose(sqlite3_vfs *self, void *library) {
    (void)self;
    parent->xDlClose(parent, library);
}

static int vfsRandomness(sqlite3_vfs *self, int size, char *out) {
    (void)self;
    return parent->xRandomness(parent, size, out);
}

static int vfsSleep(sqlite3_vfs *self, int microseconds) {
    (void)self;
    return parent->xSleep(parent, microseconds);
}

static int vfsCurrentTime(sqlite3_vfs *self, double *now) {
    (void)self;
    return parent->xCurrentTime(parent, now);
}

static int vfsGetLastError(sqlite3_vfs *self, int size, char *message) {
    (void)self;
    return parent->xGetLastError(parent, size, message);
}

static int vfsCurrentTimeInt64(sqlite3_vfs *self, sqlite3_int64 *now) {
    (void)self;
    return parent->xCurrentTimeInt64(parent, now);
}

static void registerOnce(void) {
    parent = sqlite3_vfs_find(0);
    // A default VFS older than version 2 has no xCurrentTimeInt64 for this one to hand on.
    if (!parent || parent->iVersion < 2) return;
    methods = (sqlite3_io_methods){
        .iVersion = 1,
        .xClose = walClose,
        .xRead = walRead,
        .xWrite = walWrite,
        .xTruncate = walTruncate,
        .xSync = walSync,
        .xFileSize = walFileSize,
        .xLock = walLock,
        .xUnlock = walUnlock,
        .xCheckReservedLock = walCheckReservedLock,
        .xFileControl = walFileControl,
        .xSectorSize = walSectorSize,
        .xDeviceCharacteristics = walDeviceCharacteristics,
    };
    vfs = (sqlite3_vfs){
        .iVersion = 2,
        .szOsFile = (int)sizeof(WALFile) + parent->szOsFile,
        .mxPathname = parent->mxPathname,
        .zName = dq_wal_writes_vfs_name,
        .xOpen = vfsOpen,
        .xDelete = vfsDelete,
        .xAccess = vfsAccess,
        .xFullPathname = vfsFullPathname,
        .xDlOpen = vfsDlOpen,
        .xDlError = vfsDlError,
        .xDlSym = vfsDlSym,
        .xDlClose = vfsDlClose,
        .xRandomness = vfsRandomness,
        .xSleep = vfsSleep,
        .xCurrentTime = vfsCurrentTime,
        .xGetLastError = vfsGetLastError,
        .xCurrentTimeInt64 = vfsCurrentTimeInt64,
    };
    registered = sqlite3_vfs_register(&vfs, 0);
}

int dq_wal_writes_register(void) {
    pthread_once(&once, registerOnce);
    return registered;
}

int dq_wal_writes_count(sqlite3 *db, sqlite3_int64 *count) {
    sqlite3_file *wal = 0;
    int rc = sqlite3_file_control(db, "main", SQLITE_FCNTL_JOURNAL_POINTER, &wal);
    if (rc != SQLITE_OK) return rc;
    if (!wal || wal->pMethods != &methods) return SQLITE_NOTFOUND;
    return wal->pMethods->xFileControl(wal, countControl, count);
}
