"""Where calls come in: the OpenAI Realtime WebSocket, WebRTC, the phone media-stream bridges and
SIP. Each turns its wire protocol into one `gateway.session.Session`."""
