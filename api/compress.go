package api

// Compressed requests, as Triton's clients send them: tritonclient.http's
// request_compression_algorithm "gzip" or "deflate" posts the whole body
// (JSON header and binary tensors) through gzip.compress or zlib.compress
// with Content-Encoding: gzip or deflate, and the
// Inference-Header-Content-Length of the body before compression
// (http/_client.py infer); tritonclient.grpc's compression_algorithm asks
// gRPC for its gzip or deflate message compression (grpc/_client.py infer).
//
// A compressed body is counted by what it decompresses to: it is
// decompressed as it arrives and stops at limits.max_request_bytes (413 /
// RESOURCE_EXHAUSTED), each growth of the decompressed body reserved from
// limits.max_memory first (429), so a small body that inflates without end
// (a zip bomb) costs the server at most the limit. gRPC does the same for
// messages: it reads at most MaxRecvMsgSize (max_request_bytes) bytes out
// of a decompressor, and a message's decompressed form lies within the two
// max_request_bytes the call reserved when its headers arrived.

import (
	"compress/gzip"
	"compress/zlib"
	"errors"
	"fmt"
	"io"
	"strings"

	"google.golang.org/grpc/encoding"
	_ "google.golang.org/grpc/encoding/gzip" // registers gRPC's gzip compressor
)

func init() {
	// gRPC's compressors are a process-wide registry that must be filled
	// at initialisation. "deflate" is zlib's format, as gRPC's C core (and
	// so tritonclient.grpc) sends it.
	encoding.RegisterCompressor(deflateCompressor{})
}

// deflateCompressor is gRPC's "deflate" message compression.
type deflateCompressor struct{}

var _ encoding.Compressor = deflateCompressor{}

func (deflateCompressor) Name() string { return "deflate" }

func (deflateCompressor) Compress(w io.Writer) (io.WriteCloser, error) {
	return zlib.NewWriter(w), nil
}

func (deflateCompressor) Decompress(r io.Reader) (io.Reader, error) {
	return zlib.NewReader(r)
}

// restDecoderMemory is what a decompressor holds while it decompresses (a
// 32 KiB window and its buffers), reserved with the body.
const restDecoderMemory = 64 << 10

// restContentDecoder returns the decoder of a REST body's Content-Encoding:
// nil for none (or identity), errUnsupportedEncoding for one the server
// does not decode.
func restContentDecoder(header string) (func(io.Reader) (io.ReadCloser, error), error) {
	switch strings.ToLower(strings.TrimSpace(header)) {
	case "", "identity":
		return nil, nil
	case "gzip", "x-gzip":
		return func(r io.Reader) (io.ReadCloser, error) { return gzip.NewReader(r) }, nil
	case "deflate":
		return zlib.NewReader, nil
	}
	return nil, fmt.Errorf("%w: Content-Encoding %q; send the body uncompressed, or as gzip or deflate", errUnsupportedEncoding, clipValue(header))
}

// errDecodedTooLarge is a compressed body that decompresses past the limit.
var errDecodedTooLarge = errors.New("the body decompresses past the limit")

// decodeError is a compressed body that does not decompress: not of its
// Content-Encoding, corrupt or cut short.
type decodeError struct {
	encoding string
	err      error
}

func (e *decodeError) Error() string { return e.err.Error() }
func (e *decodeError) Unwrap() error { return e.err }

// decodingReader decompresses src as it is read, handing out at most
// limit bytes (0: no limit): one more is errDecodedTooLarge. Errors of src
// itself (its size limit, its deadline) pass unchanged; the decompressor's
// own are decodeErrors.
type decodingReader struct {
	src      *srcErrors
	open     func(io.Reader) (io.ReadCloser, error)
	encoding string
	zr       io.ReadCloser
	limit    int64
	n        int64
}

// srcErrors remembers the last error of the reader the decompressor
// reads, so that it is told apart from the decompressor's.
type srcErrors struct {
	r   io.Reader
	err error
}

func (s *srcErrors) Read(p []byte) (int, error) {
	n, err := s.r.Read(p)
	if err != nil && err != io.EOF {
		s.err = err
	}
	return n, err
}

func newDecodingReader(src io.Reader, open func(io.Reader) (io.ReadCloser, error), encoding string, limit int64) *decodingReader {
	return &decodingReader{src: &srcErrors{r: src}, open: open, encoding: encoding, limit: limit}
}

func (d *decodingReader) Read(p []byte) (int, error) {
	if d.zr == nil {
		zr, err := d.open(d.src)
		if err != nil {
			return 0, d.wrap(err)
		}
		d.zr = zr
	}
	if d.limit > 0 {
		if d.n > d.limit {
			return 0, errDecodedTooLarge
		}
		if room := d.limit + 1 - d.n; int64(len(p)) > room {
			p = p[:room]
		}
	}
	n, err := d.zr.Read(p)
	d.n += int64(n)
	if d.limit > 0 && d.n > d.limit {
		return n, errDecodedTooLarge
	}
	if err != nil && err != io.EOF {
		return n, d.wrap(err)
	}
	return n, err
}

// wrap tells the source's errors (passed on) from the decompressor's.
func (d *decodingReader) wrap(err error) error {
	if d.src.err != nil {
		return d.src.err
	}
	if err == io.EOF {
		err = io.ErrUnexpectedEOF // an empty body is no gzip or zlib stream
	}
	return &decodeError{encoding: d.encoding, err: err}
}
