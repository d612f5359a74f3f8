-- Memory benchmark: PUT /accounts/0 .. /accounts/LIMIT-1 once each (token 1), then stop.
-- Arguments (after `--`): LIMIT (default 1000000), MARKER (a file created when LIMIT responses
-- have arrived; bench/run then ends wrk with SIGINT, which still prints the summary: a wrk
-- thread that stops itself does not end wrk before -d). Requests in flight at the end repeat
-- ids, so at most LIMIT resources exist.
local dir = debug.getinfo(1, "S").source:match("^@(.*/)") or "./"
dofile(dir .. "report.lua")

local limit, marker, sent, got = 1000000, nil, 0, 0
local body = '{"balance":100}\n'

init = function(args)
  limit = tonumber(args[1]) or limit
  marker = args[2]
end

request = function()
  local id = sent % limit
  sent = sent + 1
  return wrk.format("PUT", "/accounts/" .. id, {
    ["Fencing-Token"] = "1",
    ["Content-Type"] = "application/json",
  }, body)
end

response = function(status, headers, body)
  got = got + 1
  if got == limit then
    if marker then
      local f = io.open(marker, "w")
      if f then f:write(got, "\n"); f:close() end
    end
    wrk.thread:stop()
  end
end
