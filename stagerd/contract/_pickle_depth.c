/* The nesting-depth scan of a pickle's opcodes, for stagerd/contract/pickle_depth.py, which holds the rules,
 * builds the opcode table from pickletools and runs the same scan in Python (`scan_py`): this file follows
 * it line for line, so both give the same (verdict, byte, detail) on every input.
 *
 * scan(data, table, limit) -> (verdict, byte offset of the opcode, detail). `table` is 256 rows of 8 bytes:
 * what follows the opcode (kind, size), what it does to the stack (action), how many values it takes from
 * the top or below its MARK (n, mark), and whether it makes one. A value's depth is kept on the stack, or,
 * once the memo or DUP shares it, in a cell both refer to (stored as -1 - cell; the cell holds the depth
 * times 2, plus 1 once the value was put inside another), so a value that grows after it was memoized is
 * as deep wherever it is fetched, and one that grows after it was put inside another is refused. Every array grows with the opcodes read, never
 * with a count the pickle states. The GIL is released.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

enum { OK, TOO_DEEP, TRUNCATED, UNKNOWN_OPCODE, UNDERFLOW, NO_MARK, BAD_KEY, KEY_AHEAD, NOT_STORED, NEGATIVE, GROWS_INSIDE };
enum { K_NONE, K_FIXED, K_LINE, K_TWO_LINES, K_LEN1, K_LEN4S, K_LEN4U, K_LEN8U };
enum { A_BUILD, A_MUTATE, A_MARK, A_PUT, A_GET, A_DUP, A_POP, A_STOP };
#define K_UNKNOWN 255
#define ROW 8
#define NO_MEMORY (-1)

typedef struct {
    int64_t *v;
    size_t len, cap;
} vec;

static int push(vec *a, int64_t x) {
    if (a->len == a->cap) {
        size_t cap = a->cap ? a->cap * 2 : 256;
        int64_t *v = realloc(a->v, cap * sizeof(int64_t));
        if (v == NULL) {
            return -1;
        }
        a->v = v;
        a->cap = cap;
    }
    a->v[a->len++] = x;
    return 0;
}

static uint64_t little(const unsigned char *p, int width) {
    uint64_t x = 0;
    for (int i = width - 1; i >= 0; i--) {
        x = (x << 8) | p[i];
    }
    return x;
}

typedef struct {
    int verdict;
    Py_ssize_t at;
    int64_t detail;
} result;

#define DONE(v, where, d)                                                                                \
    do {                                                                                                 \
        out.verdict = (v);                                                                               \
        out.at = (where);                                                                                \
        out.detail = (d);                                                                                \
        goto done;                                                                                       \
    } while (0)
#define PUSH(a, x)                                                                                       \
    do {                                                                                                 \
        if (push((a), (x)) < 0) {                                                                        \
            DONE(NO_MEMORY, at, 0);                                                                      \
        }                                                                                                \
    } while (0)

static result scan(const unsigned char *data, Py_ssize_t end, const unsigned char *table, int64_t limit) {
    result out = {OK, 0, 0};
    vec stack = {0}, cells = {0}, marks = {0}, memo = {0}; /* memo: key -> cell, or -1 never stored */
    size_t fence = 0;
    int64_t puts = 0, stored = 0;
    Py_ssize_t pos = 0, at = 0;
    while (pos < end) {
        at = pos;
        const unsigned char *row = table + (size_t)data[pos] * ROW;
        int kind = row[0], size = row[1], action = row[2], n = row[3], mark = row[4], makes = row[5];
        if (kind == K_UNKNOWN) {
            DONE(UNKNOWN_OPCODE, at, data[pos]);
        }
        pos++;
        Py_ssize_t start = pos;
        if (kind == K_FIXED) {
            if (size > end - pos) {
                DONE(TRUNCATED, at, 0);
            }
            pos += size;
        } else if (kind == K_LINE || kind == K_TWO_LINES) {
            for (int i = 0; i <= kind - K_LINE; i++) {
                const unsigned char *nl = memchr(data + pos, '\n', (size_t)(end - pos));
                if (nl == NULL) {
                    DONE(TRUNCATED, at, 0);
                }
                pos = nl - data + 1;
            }
        } else if (kind != K_NONE) {
            static const int widths[] = {1, 4, 4, 8};
            int width = widths[kind - K_LEN1];
            if (width > end - pos) {
                DONE(TRUNCATED, at, 0);
            }
            uint64_t length = little(data + pos, width);
            if (kind == K_LEN4S && (length & 0x80000000u)) {
                DONE(NEGATIVE, at, 0);
            }
            pos += width;
            if (length > (uint64_t)(end - pos)) {
                DONE(TRUNCATED, at, 0);
            }
            pos += (Py_ssize_t)length;
        }
        if (action == A_BUILD || action == A_MUTATE || action == A_STOP) {
            size_t top;
            if (mark) {
                if (marks.len == 0) {
                    DONE(NO_MARK, at, 0);
                }
                top = (size_t)marks.v[--marks.len];
                fence = marks.len ? (size_t)marks.v[marks.len - 1] : 0;
            } else {
                top = stack.len;
            }
            if (top < (size_t)n || top - n < fence) {
                DONE(UNDERFLOW, at, 0);
            }
            size_t lo = top - n;
            if (action == A_STOP) {
                DONE(OK, at, 0);
            }
            size_t first = action == A_MUTATE ? lo + 1 : lo;
            int keeps = action == A_MUTATE || makes;
            int64_t d = 0;
            for (size_t i = first; i < stack.len; i++) {
                int64_t v = stack.v[i];
                if (v < 0) {
                    cells.v[-1 - v] |= keeps;
                    v = cells.v[-1 - v] >> 1;
                }
                if (v >= d) {
                    d = v + 1;
                }
            }
            stack.len = first;
            if (action == A_MUTATE) {
                int64_t v = stack.v[lo];
                if (v >= 0) {
                    if (v > d) {
                        d = v;
                    }
                    stack.v[lo] = d;
                } else {
                    int64_t *cell = &cells.v[-1 - v];
                    if (d <= (*cell >> 1)) {
                        d = *cell >> 1;
                    } else if (*cell & 1) { /* its holders were counted when it was shallower */
                        DONE(GROWS_INSIDE, at, 0);
                    } else {
                        *cell = d << 1;
                    }
                }
            } else if (makes) {
                PUSH(&stack, d);
            } else {
                continue;
            }
            if (d > limit) {
                DONE(TOO_DEEP, at, d);
            }
        } else if (action == A_MARK) {
            PUSH(&marks, (int64_t)stack.len);
            fence = stack.len;
        } else if (action == A_POP) {
            if (marks.len && (size_t)marks.v[marks.len - 1] == stack.len) {
                marks.len--;
                fence = marks.len ? (size_t)marks.v[marks.len - 1] : 0;
            } else if (stack.len <= fence) {
                DONE(UNDERFLOW, at, 0);
            } else {
                stack.len--;
            }
        } else { /* PUT, GET, DUP */
            int64_t key;
            if (kind == K_LINE) {
                Py_ssize_t digits = pos - 1 - start;
                if (digits < 1 || digits > 18) {
                    DONE(BAD_KEY, at, 0);
                }
                key = 0;
                for (Py_ssize_t i = start; i < pos - 1; i++) {
                    if (data[i] < '0' || data[i] > '9') {
                        DONE(BAD_KEY, at, 0);
                    }
                    key = key * 10 + (data[i] - '0');
                }
            } else if (kind == K_FIXED) {
                key = (int64_t)little(data + start, size);
            } else {
                key = stored;
            }
            if (action == A_GET) {
                if (key >= (int64_t)memo.len || memo.v[key] < 0) {
                    DONE(NOT_STORED, at, key);
                }
                PUSH(&stack, -1 - memo.v[key]);
                continue;
            }
            if (stack.len <= fence) {
                DONE(UNDERFLOW, at, 0);
            }
            if (action == A_PUT) {
                if (key > puts) {
                    DONE(KEY_AHEAD, at, key);
                }
                puts++;
            }
            int64_t *topv = &stack.v[stack.len - 1];
            if (*topv >= 0) {
                PUSH(&cells, *topv << 1);
                *topv = -(int64_t)cells.len;
            }
            if (action == A_DUP) {
                PUSH(&stack, stack.v[stack.len - 1]);
            } else {
                while ((int64_t)memo.len <= key) { /* key <= puts: grows with the opcodes read */
                    PUSH(&memo, -1);
                }
                if (memo.v[key] < 0) {
                    stored++;
                }
                memo.v[key] = -1 - stack.v[stack.len - 1];
            }
        }
    }
    DONE(TRUNCATED, end, 0);
done:
    free(stack.v);
    free(cells.v);
    free(marks.v);
    free(memo.v);
    return out;
}

static PyObject *py_scan(PyObject *self, PyObject *args) {
    Py_buffer data, table;
    long long limit;
    if (!PyArg_ParseTuple(args, "y*y*L", &data, &table, &limit)) {
        return NULL;
    }
    int bad_row = 0;
    for (Py_ssize_t i = 0; table.len == 256 * ROW && i < 256; i++) {
        const unsigned char *row = (const unsigned char *)table.buf + i * ROW;
        bad_row |= row[0] != K_UNKNOWN && (row[0] > K_LEN8U || row[1] > 8 || row[2] > A_STOP || row[3] > 3);
    }
    if (table.len != 256 * ROW || bad_row || limit < 0) {
        PyBuffer_Release(&data);
        PyBuffer_Release(&table);
        PyErr_SetString(PyExc_ValueError, "scan: the table must be 256 valid rows of 8 bytes, the limit >= 0");
        return NULL;
    }
    result r;
    Py_BEGIN_ALLOW_THREADS;
    r = scan((const unsigned char *)data.buf, data.len, (const unsigned char *)table.buf, limit);
    Py_END_ALLOW_THREADS;
    PyBuffer_Release(&data);
    PyBuffer_Release(&table);
    if (r.verdict == NO_MEMORY) {
        return PyErr_NoMemory();
    }
    return Py_BuildValue("(inL)", r.verdict, r.at, (long long)r.detail);
}

static PyMethodDef methods[] = {
    {"scan", py_scan, METH_VARARGS, "scan(data, table, limit) -> (verdict, byte, detail)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_pickle_depth", NULL, -1, methods};

PyMODINIT_FUNC PyInit__pickle_depth(void) { return PyModule_Create(&module); }
