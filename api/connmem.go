package api

// What one open connection holds for its whole life, outside the requests
// it carries, reserved from limits.max_memory by the listener that accepted
// it (LimitedListener.ReserveMemory). Each is a bound, not an average: an
// idle connection holds less (TestConnectionBytesCoverIdleConnections
// measures them against these).

const (
	// grpcWriteBufferSize is grpc-go's default write buffer, set
	// explicitly (GRPCTransportOptions) so that the count below follows
	// it. grpc-go's server shares it by default (taken from a pool while
	// frames are batched, given back at each flush), so an idle connection
	// holds none; a connection writing holds all of it.
	grpcWriteBufferSize = 32 << 10

	// grpcFrameBuffer is x/net/http2's Framer's read buffer: it keeps the
	// buffer of the largest frame read so far (frame.go, getReadBuf), at
	// most SETTINGS_MAX_FRAME_SIZE, which grpc-go's server sets to 16 KiB
	// (http2MaxFrameLen).
	grpcFrameBuffer = http2MaxFrame

	// grpcConnectionState is the rest of a gRPC connection: the transport,
	// its loopy writer and control buffer, the HPACK tables (4 KiB each
	// way), and the stacks of its three goroutines (reader, writer,
	// keepalive). An idle connection holds 12-15 KiB over its read
	// buffer (143,250-147,101 bytes a connection in ten runs of
	// TestConnectionBytesCoverIdleConnections, less 131,072); 16 KiB.
	grpcConnectionState = 16 << 10

	// GRPCConnectionBytes is a gRPC connection of NewGRPC with
	// GRPCTransportOptions: grpc-go's reader holds a bufio.Reader of
	// grpcReadBufferSize for the connection's life (transport.newFramer,
	// http_util.go; its pooled reader is only used on a bare
	// *net.TCPConn, and the listener's connections are not), its writer up
	// to grpcWriteBufferSize, the framer grpcFrameBuffer and the rest
	// grpcConnectionState: 192 KiB.
	GRPCConnectionBytes = grpcReadBufferSize + grpcWriteBufferSize + grpcFrameBuffer + grpcConnectionState

	// ModelMeshConnectionBytes is a connection of the ModelMesh SPI's gRPC
	// server, which keeps grpc-go's default 32 KiB read and write buffers:
	// 96 KiB.
	ModelMeshConnectionBytes = 32<<10 + 32<<10 + grpcFrameBuffer + grpcConnectionState

	// RESTConnectionBytes is an HTTP/1.1 connection of net/http's server:
	// a 4 KiB bufio.Reader and a 4 KiB bufio.Writer held for the
	// connection's life (server.go, conn.serve: newBufioReader,
	// newBufioWriterSize(4<<10)), while a request is in progress its
	// response's 2 KiB buffer (bufferBeforeChunkingSize), and 14 KiB for
	// the connection's state, its goroutine's stack, the request and gin's
	// Context (taken from gin's pool for each request). An idle connection
	// after one request holds 16-17 KiB (16,356-17,694 bytes in the same
	// runs): 24 KiB.
	RESTConnectionBytes = 4<<10 + 4<<10 + 2<<10 + 14<<10

	// TLSConnectionBytes is what TLS adds to a connection: crypto/tls
	// keeps a buffer of the largest record read (its rawInput grows to a
	// record header and maxCiphertext, 18,437 bytes) and one of the
	// largest written (outBuf, as much), and what is left of the
	// handshake: 40 KiB, counted from crypto/tls's conn.go, not measured.
	TLSConnectionBytes = 40 << 10

	// RESTHTTP2Bytes is what HTTP/2 (offered to REST clients over TLS)
	// adds over HTTP/1.1: the framer's read buffer of the largest frame
	// (restMaxReadFrameSize, which newRESTServer sets) and the HPACK
	// tables. Counted, not measured.
	RESTHTTP2Bytes = RESTMaxReadFrameSize + 8<<10

	// RESTMaxReadFrameSize is the largest HTTP/2 frame the REST server
	// reads (net/http's default is 1 MiB, which a client sending large
	// frames would make every connection keep).
	RESTMaxReadFrameSize = 16 << 10
)

// grpcStreamState is what one open gRPC stream keeps beside its headers
// and the messages being read, counted from grpc-go's source: grpc-go's
// transport stream (transport.ServerStream with its
// recvBuffer, inFlow and writeQuota, its context) and stream.go's
// serverStream (its parser, codec and stats), under 4 KiB; the goroutine
// that serves it, whose stack starts at 8 KiB and doubles as it deepens
// (a handler waiting in RecvMsg, some twenty frames deep, stays within 16
// KiB); and ModelStreamInfer's goroutine that sends its answers (8 KiB)
// with its channels: 32 KiB. An idle ModelStreamInfer stream without
// headers of its own takes 11-15 KiB (10,977-15,032 bytes a stream in
// 24 runs of TestStreamBytesCoverIdleStreams).
const grpcStreamState = 32 << 10

// grpcDefaultMaxHeaderList is grpc-go's own cap on a call's headers when
// the server sets none (defaultServerMaxHeaderListSize).
const grpcDefaultMaxHeaderList = 16 << 20

// GRPCStreamBytes is what one open gRPC stream holds for its whole life,
// idle or not, outside the messages being read: its state
// (grpcStreamState) and its headers, which grpc-go keeps decoded in the
// stream's context (metadata.MD) until it ends. HTTP/2 caps them at
// maxHeader (grpc.MaxHeaderListSize, limits.max_header_bytes; <= 0:
// grpc-go's default), counting each field as its name and value and 32
// bytes; Go's map slot, the value's slice and the strings' size classes
// take at most 128 bytes a field beyond its name and value, and a -bin
// field is kept decoded too (3/4 of its length): at most four times the
// cap. With 16 KiB of headers an idle stream takes 37-49 KiB of the 96
// reserved (TestStreamBytesCoverIdleStreams: 390 small fields
// 45,465-49,520 bytes, 120 -bin fields 37,273-40,427, 24 runs:
// go test -run 'TestStreamBytesCoverIdleStreams$' -v ./api).
func GRPCStreamBytes(maxHeader int64) int64 {
	if maxHeader <= 0 {
		maxHeader = grpcDefaultMaxHeaderList
	}
	return grpcStreamState + 4*maxHeader
}

// ConnectionBytes is what one connection of a listener serving kind
// ("grpc", "modelmesh", "rest"; anything else is counted as REST) holds,
// with TLS or not.
func ConnectionBytes(kind string, tls bool) int64 {
	var n int64
	switch kind {
	case "grpc":
		n = GRPCConnectionBytes
	case "modelmesh":
		n = ModelMeshConnectionBytes
	default:
		n = RESTConnectionBytes
		if tls {
			n += RESTHTTP2Bytes
		}
	}
	if tls {
		n += TLSConnectionBytes
	}
	return n
}
