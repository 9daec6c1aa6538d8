import csv, sys
rows = list(csv.reader(open(sys.argv[1])))
hdr = rows[1]; data = rows[2:]
ix = {h:i for i,h in enumerate(hdr)}
reasons = [h for h in hdr if h.startswith('stall_') and '(Not Issued)' not in h]
base = int(data[0][0],16)
tot = sum(int(r[ix['Warp Stall Sampling (All Samples)']] or 0) for r in data)
print('total samples', tot)
out=[]
for r in data:
    a = int(r[0],16)-base; s = int(r[ix['Warp Stall Sampling (All Samples)']] or 0)
    ex = r[ix['Instructions Executed']]
    rs = sorted(((int(r[ix[h]] or 0), h[6:]) for h in reasons), reverse=True)[:3]
    rs = ' '.join(f'{n}:{v}' for v,n in rs if v>0)
    out.append(f'{a:05x} {ex:>8} {s:6d} {r[1].strip()[:70]:70s} {rs}')
open(sys.argv[2],'w').write('\n'.join(out))
